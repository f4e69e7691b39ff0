"""The agent's one settings object, validated at start-up.

Sections and keys follow ``deploy/config/agent.toml``. Precedence (highest first):
command-line argument > environment ``TPFLEX_<SECTION>__<KEY>`` (e.g.
``TPFLEX_AGENT__RACK``) > TOML file (``--config`` or ``TPFLEX_AGENT_CONFIG``) > default.
An unknown key in the file or in one of the agent's sections of the environment is
refused, naming the key and where it came from.
"""

from __future__ import annotations

import json
import os
import re
import socket
import tomllib
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

CONFIG_ENV = "TPFLEX_AGENT_CONFIG"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_HOSTPORT = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9._-]+):(\d{1,5})$")


class ConfigError(ValueError):
    """The configuration is unusable; the message names the key and its source."""


def _hostport(value: str, what: str) -> str:
    m = _HOSTPORT.match(value)
    if not m or int(m.group(2)) > 65535:
        raise ValueError(f"{what} must be HOST:PORT with a port in 0..65535, got {value!r}")
    return value


def _readable(path: str, what: str) -> str:
    if path and not os.access(path, os.R_OK):
        raise ValueError(f"{what} {path!r} is not a readable file")
    return path


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AgentSection(_Section):
    node: str = Field("", description="node name in etcd; empty = the host name")
    rack: str = Field("rack0", description="the NVLink domain this node belongs to")
    backend: Literal["nvml", "sim"] = "nvml"
    sim_gpus: int = Field(8, ge=1, le=1024)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v

    @field_validator("node", "rack")
    @classmethod
    def _name(cls, v: str, info) -> str:
        if info.field_name == "node" and not v:
            v = socket.gethostname().split(".")[0]
        if not _NAME.match(v):
            raise ValueError(f"must be 1-63 letters, digits, '.', '_' or '-', got {v!r}")
        return v


class EtcdSection(_Section):
    endpoints: list[str] = Field(default_factory=list, description="empty = standalone")
    lease_ttl_s: int = Field(5, ge=1, le=300)
    dial_timeout_s: float = Field(2.0, gt=0, le=60)
    username: str = ""
    password_file: str = ""
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    @field_validator("endpoints", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        """Environment values: a JSON list or comma-separated HOST:PORTs."""
        if isinstance(v, str) and v.lstrip().startswith("["):
            try:
                return json.loads(v)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON list: {exc}") from exc
        return [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else v

    @field_validator("endpoints")
    @classmethod
    def _endpoints(cls, v: list[str]) -> list[str]:
        return [_hostport(re.sub(r"^https?://", "", e), "etcd endpoint") for e in v]

    @model_validator(mode="after")
    def _files(self) -> EtcdSection:
        for name in ("password_file", "ca_file", "cert_file", "key_file"):
            _readable(getattr(self, name), name)
        if self.username and not self.password_file:
            raise ValueError("username needs password_file")
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("cert_file and key_file go together")
        return self


class _Listener(_Section):
    listen: str
    advertise_address: str = Field("", description="host:port others dial; empty = <host name>:<port>")
    tls_cert_file: str = ""
    tls_key_file: str = ""

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        return _hostport(v, "listen")

    @model_validator(mode="after")
    def _tls(self):
        _readable(self.tls_cert_file, "tls_cert_file")
        _readable(self.tls_key_file, "tls_key_file")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together")
        return self

    @property
    def host(self) -> str:
        return self.listen.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])

    def advertised(self, bound_port: int) -> str:
        if self.advertise_address:
            return self.advertise_address
        host = self.host
        if host in ("0.0.0.0", "[::]", ""):
            host = socket.gethostname()
        return f"{host}:{bound_port}"


class GrpcSection(_Listener):
    listen: str = "0.0.0.0:8472"
    client_ca_file: str = Field("", description="require client certificates signed by this CA")
    client_names: list[str] = Field(
        default_factory=list, description="with client_ca_file: accepted certificate CNs; empty = any"
    )

    @field_validator("client_names", mode="before")
    @classmethod
    def _names(cls, v: Any) -> Any:
        if isinstance(v, str) and v.lstrip().startswith("["):
            try:
                return json.loads(v)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON list: {exc}") from exc
        return [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _ca(self) -> GrpcSection:
        _readable(self.client_ca_file, "client_ca_file")
        if self.client_ca_file and not self.tls_cert_file:
            raise ValueError("client_ca_file needs tls_cert_file and tls_key_file")
        return self


class MetricsSection(_Listener):
    listen: str = "0.0.0.0:8473"


class HealthSection(_Section):
    debounce_s: float = Field(1.0, ge=0, le=300, description="routine readings at most this often")
    poll_s: float = Field(0.5, gt=0, le=60)


class AgentSettings(_Section):
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


SECTIONS: dict[str, type[_Section]] = {
    name: f.annotation for name, f in AgentSettings.model_fields.items()  # type: ignore[misc]
}


def _check_keys(data: Mapping[str, Any], where: str) -> None:
    for section, values in data.items():
        if section not in SECTIONS or not isinstance(values, dict):
            raise ConfigError(f"unknown configuration key {section!r} in {where}")
        for key in values:
            if key not in SECTIONS[section].model_fields:
                raise ConfigError(f"unknown configuration key '{section}.{key}' in {where}")


def _read_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    _check_keys(data, f"config file {path}")
    return data


def _read_env(env: Mapping[str, str]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for name, value in env.items():
        if not name.startswith("TPFLEX_") or "__" not in name:
            continue
        section, _, key = name[len("TPFLEX_"):].lower().partition("__")
        if section not in SECTIONS:
            continue  # another service's section (the controller's), not ours
        if key not in SECTIONS[section].model_fields:
            raise ConfigError(f"unknown configuration key '{section}.{key}' in environment variable {name}")
        out.setdefault(section, {})[key] = value
    return out


def load_settings(
    args: Mapping[str, Mapping[str, Any]], env: Mapping[str, str], config_file: str | None = None,
) -> AgentSettings:
    """Merge ``{section: {key: value}}`` layers by precedence and validate.
    Raises :class:`ConfigError` with the offending key and its source."""
    path = config_file or env.get(CONFIG_ENV)
    layers = [
        (_read_file(path) if path else {}, f"config file {path}"),
        (_read_env(env), "environment"),
        ({s: {k: v for k, v in kv.items() if v is not None} for s, kv in args.items()}, "command line"),
    ]
    merged: dict[str, dict[str, Any]] = {}
    source: dict[tuple[str, str], str] = {}
    for values, where in layers:
        for section, kv in values.items():
            for k, v in kv.items():
                merged.setdefault(section, {})[k] = v
                source[(section, k)] = (
                    f"environment TPFLEX_{section.upper()}__{k.upper()}" if where == "environment" else where
                )
    try:
        return AgentSettings(**merged)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = [str(p) for p in err["loc"]]
            key = ".".join(loc[:2]) if loc else "?"
            if len(loc) >= 2:
                origin = source.get((loc[0], loc[1]), "default")
            else:  # a check across keys of a section: name where its keys came from
                origin = ", ".join(sorted({w for (sec, _), w in source.items() if loc and sec == loc[0]})) or "default"
            problems.append(f"{key} (from {origin}): {err['msg']}")
        raise ConfigError("invalid configuration: " + "; ".join(problems)) from exc
