"""The agent's one settings object, validated at start-up.

Precedence (highest first): command-line argument > environment variable
``TPFLEX_AGENT_<NAME>`` > TOML config file (``--config`` or ``TPFLEX_AGENT_CONFIG``) >
default. Unknown keys in the file or unknown ``TPFLEX_AGENT_*`` variables are refused,
naming the key and where it came from.
"""

from __future__ import annotations

import re
import socket
import tomllib
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ENV_PREFIX = "TPFLEX_AGENT_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_HOSTPORT = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9._-]+):(\d{1,5})$")


class ConfigError(ValueError):
    """The configuration is unusable; the message names the key and its source."""


def _hostport(value: str, what: str) -> str:
    m = _HOSTPORT.match(value)
    if not m or int(m.group(2)) > 65535:
        raise ValueError(f"{what} must be HOST:PORT with a port in 0..65535, got {value!r}")
    return value


class AgentSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["nvml", "sim"] = "nvml"
    sim_gpus: int = Field(8, ge=1, le=1024, description="GPUs of the simulated backend")
    rack: str = Field("rack0", description="the NVLink domain this node belongs to")
    node: str = Field(default_factory=lambda: socket.gethostname().split(".")[0])
    etcd: list[str] = Field(default_factory=list, description="etcd endpoints HOST:PORT; empty = standalone")
    etcd_timeout_s: float = Field(2.0, gt=0, le=60)
    listen: str = Field("0.0.0.0:50061", description="gRPC address; port 0 picks a free port")
    advertise_host: str = Field("", description="host the controller dials; default: listen host or hostname")
    metrics_host: str = "0.0.0.0"
    metrics_port: int = Field(9401, ge=0, le=65535, description="/metrics port; 0 picks a free port")
    lease_ttl_s: int = Field(5, ge=1, le=300)
    health_poll_s: float = Field(0.5, gt=0, le=60)
    health_debounce_s: float = Field(2.0, ge=0, le=300)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @field_validator("rack", "node")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"must be 1-63 characters of letters, digits, '.', '_', '-', got {v!r}")
        return v

    @field_validator("etcd", mode="before")
    @classmethod
    def _split_etcd(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [p.strip() for p in v.split(",") if p.strip()]
        return v

    @field_validator("etcd")
    @classmethod
    def _endpoints(cls, v: list[str]) -> list[str]:
        return [_hostport(e, "etcd endpoint") for e in v]

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        return _hostport(v, "listen")

    @property
    def listen_host(self) -> str:
        return self.listen.rsplit(":", 1)[0]

    def advertised(self, port: int) -> str:
        host = self.advertise_host or self.listen_host
        if host in ("0.0.0.0", "[::]", ""):
            host = socket.gethostname()
        return f"{host}:{port}"


FIELDS = tuple(AgentSettings.model_fields)


def _read_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    for key in data:
        if key not in FIELDS:
            raise ConfigError(f"unknown configuration key {key!r} in {path}")
    return data


def _read_env(env: Mapping[str, str]) -> dict[str, str]:
    out = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name == CONFIG_ENV:
            continue
        key = name[len(ENV_PREFIX):].lower()
        if key not in FIELDS:
            raise ConfigError(f"unknown configuration key {key!r} in environment variable {name}")
        out[key] = value
    return out


def load_settings(
    args: Mapping[str, Any], env: Mapping[str, str], config_file: str | None = None,
) -> AgentSettings:
    """Merge the sources by precedence and validate; :class:`ConfigError` on bad input."""
    path = config_file or env.get(CONFIG_ENV)
    layers = [
        (_read_file(path) if path else {}, f"config file {path}"),
        (_read_env(env), "environment"),
        ({k: v for k, v in args.items() if v is not None}, "command line"),
    ]
    merged: dict[str, Any] = {}
    source: dict[str, str] = {}
    for values, where in layers:
        for k, v in values.items():
            merged[k] = v
            source[k] = where if where != "environment" else f"environment {ENV_PREFIX}{k.upper()}"
    try:
        return AgentSettings(**merged)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = str(err["loc"][0]) if err["loc"] else "?"
            problems.append(f"{key} (from {source.get(key, 'default')}): {err['msg']}")
        raise ConfigError("invalid configuration: " + "; ".join(problems)) from exc
