"""The agent's one settings object, validated at start-up.

Sections and keys follow ``deploy/config/agent.toml``. Precedence (highest first):
command-line argument > environment ``TPFLEX_<SECTION>__<KEY>`` (e.g.
``TPFLEX_AGENT__RACK``) > TOML file (``--config`` or ``TPFLEX_AGENT_CONFIG``) > default.
An unknown key in the file or in one of the agent's sections of the environment is
refused, naming the key and where it came from.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator
from tpflex_proto import config

CONFIG_ENV = "TPFLEX_AGENT_CONFIG"
ConfigError = config.ConfigError

class AgentSection(config.Section):
    node: str = Field("", description="node name in etcd; empty = the host name")
    rack: str = Field("rack0", description="the NVLink domain this node belongs to")
    backend: Literal["nvml", "sim"] = "nvml"
    sim_gpus: int = Field(8, ge=1, le=1024)
    log_level: config.LogLevel = "INFO"

    @field_validator("node", "rack")
    @classmethod
    def _name(cls, v: str, info) -> str:
        if info.field_name == "node" and not v:
            v = socket.gethostname().split(".")[0]
        return config.valid_name(v)


class EtcdSection(config.EtcdClientSection):
    endpoints: list[str] = Field(default_factory=list, description="empty = standalone")


class _Listener(config.Listener):
    advertise_address: str = Field("", description="host:port others dial; empty = <host name>:<port>")

    @property
    def host(self) -> str:
        return self.listen.rsplit(":", 1)[0]

    def advertised(self, bound_port: int) -> str:
        if self.advertise_address:
            return self.advertise_address
        host = self.host
        if host in ("0.0.0.0", "[::]", ""):
            host = socket.gethostname()
        return f"{host}:{bound_port}"


class GrpcSection(config.ClientCaListener, _Listener):
    listen: str = "0.0.0.0:8472"


class MetricsSection(_Listener):
    listen: str = "0.0.0.0:8473"


class HealthSection(config.Section):
    debounce_s: float = Field(1.0, ge=0, le=300, description="routine readings at most this often")
    poll_s: float = Field(0.5, gt=0, le=60)


class AgentSettings(config.Section):
    agent: AgentSection = Field(default_factory=AgentSection)
    etcd: EtcdSection = Field(default_factory=EtcdSection)
    grpc: GrpcSection = Field(default_factory=GrpcSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)
    health: HealthSection = Field(default_factory=HealthSection)

    @property
    def node(self) -> str:
        return self.agent.node

    @property
    def rack(self) -> str:
        return self.agent.rack

    def masked(self) -> dict[str, Any]:
        """The effective configuration for printing (secrets are files, not values)."""
        return self.model_dump()


def load_settings(
    args: Mapping[str, Mapping[str, Any]], env: Mapping[str, str], config_file: str | None = None,
) -> AgentSettings:
    """Merge ``{section: {key: value}}`` layers by precedence and validate.
    Raises :class:`ConfigError` with the offending key and its source."""
    return config.load_layers(AgentSettings, args, env, config_file or env.get(CONFIG_ENV))


__all__ = [
    "AgentSection", "AgentSettings", "ConfigError", "EtcdSection", "GrpcSection", "HealthSection",
    "MetricsSection", "load_settings",
]
