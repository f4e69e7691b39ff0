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

from pydantic import Field, field_validator, model_validator
from tpflex_proto import config

CONFIG_ENV = "TPFLEX_AGENT_CONFIG"
ConfigError = config.ConfigError

class AgentSection(config.Section):
    node: str = Field("", description="node name in etcd; empty = the host name")
    rack: str = Field("", description="the NVLink domain this node belongs to; empty = from the"
                      " GPUs' NVLink fabric (nvl-<cluster uuid>-<clique id>), else rack0")
    backend: Literal["nvml", "sim"] = "nvml"
    sim_gpus: int = Field(8, ge=1, le=1024)
    sim_fabric: str = Field("", description="simulated GPUs' NVLink fabric as <cluster uuid>/<clique"
                            " id>; empty = none (as on HGX)")
    log_level: config.LogLevel = "INFO"

    @field_validator("node", "rack")
    @classmethod
    def _name(cls, v: str, info) -> str:
        if info.field_name == "node" and not v:
            v = socket.gethostname().split(".")[0]
        if info.field_name == "rack" and not v:
            return v  # chosen at start from the fabric (tpflex_agent.fabric)
        return config.valid_name(v)

    @field_validator("sim_fabric")
    @classmethod
    def _fabric(cls, v: str) -> str:
        if v:
            sim_fabric(v)
        return v

    def sim_fabric_info(self):
        return sim_fabric(self.sim_fabric) if self.sim_fabric else None


def sim_fabric(text: str):
    """``<cluster uuid>/<clique id>`` -> a registered FabricInfo; ValueError says why."""
    import uuid

    from .backend import FabricInfo, FabricState

    cluster, sep, clique = text.partition("/")
    try:
        canonical = str(uuid.UUID(cluster))
        clique_id = int(clique)
    except ValueError:
        raise ValueError(f"must be <cluster uuid>/<clique id>, got {text!r}") from None
    if not sep or not 0 <= clique_id < 2**32:
        raise ValueError(f"must be <cluster uuid>/<clique id 0..2^32-1>, got {text!r}")
    return FabricInfo(canonical, clique_id, FabricState.COMPLETED)


class EtcdSection(config.EtcdClientSection):
    endpoints: list[str] = Field(default_factory=list, description="empty = standalone")


class _Listener(config.Listener):
    advertise_address: str = Field("", description="host:port others dial; empty = <host name>:<port>")

    @field_validator("advertise_address")
    @classmethod
    def _advertise(cls, v: str) -> str:
        # what the agent registers and the controller dials: a HOST:PORT with a real port
        if v and (config.hostport(v, "advertise_address") and v.rsplit(":", 1)[1].lstrip("0") == ""):
            raise ValueError(f"advertise_address needs a port in 1..65535, got {v!r}")
        return v

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
    insecure: bool = Field(
        False, description="serve gRPC in plaintext (no TLS): anyone who reaches the port may "
        "call it; an explicit choice for development only (--insecure)",
    )


class MetricsSection(_Listener):
    listen: str = "0.0.0.0:8473"


class HealthSection(config.Section):
    debounce_s: float = Field(1.0, ge=0, le=300, description="routine readings at most this often")
    poll_s: float = Field(0.5, gt=0, le=60)


class PowerSection(config.Section):
    check_s: float = Field(
        5.0, gt=0, le=600, description="re-read the desired caps in etcd and check the devices' "
        "limits against them this often (a divergence is corrected)",
    )


class AgentSettings(config.Section):
    agent: AgentSection = Field(default_factory=AgentSection)
    etcd: EtcdSection = Field(default_factory=EtcdSection)
    grpc: GrpcSection = Field(default_factory=GrpcSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)
    health: HealthSection = Field(default_factory=HealthSection)
    power: PowerSection = Field(default_factory=PowerSection)

    @model_validator(mode="after")
    def _plaintext_is_explicit(self) -> AgentSettings:
        """Checked across the whole configuration (after every key's own check), so that
        other mistakes are reported too."""
        g = self.grpc
        if not g.tls_cert_file and not g.insecure:
            raise ValueError(
                "gRPC without TLS needs an explicit --insecure (grpc.insecure = true); give "
                "grpc.tls_cert_file and grpc.tls_key_file, and grpc.client_ca_file for mTLS "
                "(docs/deploy.md)")
        if g.tls_cert_file and g.insecure:
            raise ValueError("grpc.insecure = true contradicts grpc.tls_cert_file: choose one")
        return self

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
    "MetricsSection", "PowerSection", "load_settings",
]
