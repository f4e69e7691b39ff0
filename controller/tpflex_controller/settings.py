"""The controller's one settings object, validated at start-up.

Sections and keys follow ``deploy/config/controller.toml``. Precedence (highest first):
command-line argument > environment ``TPFLEX_<SECTION>__<KEY>`` (e.g.
``TPFLEX_ETCD__ENDPOINTS``; lists as JSON or comma-separated) > TOML file (``--config`` or
``TPFLEX_CONTROLLER_CONFIG``) > default. Unknown keys are refused, naming the key and its
source; bad values raise :class:`ConfigError` with a message (``tpflex-controller`` exits 2).
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

CONFIG_ENV = "TPFLEX_CONTROLLER_CONFIG"
ENV_PREFIX = "TPFLEX_"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_HOSTPORT = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9._-]+):(\d{1,5})$")


class ConfigError(ValueError):
    """The configuration is unusable; the message names the key and its source."""


def _hostport(value: str, what: str) -> str:
    m = _HOSTPORT.match(value)
    if not m or int(m.group(2)) > 65535:
        raise ValueError(f"{what} must be HOST:PORT with a port in 0..65535, got {value!r}")
    return value


def _readable(path: str, what: str) -> None:
    if path and not os.access(path, os.R_OK):
        raise ValueError(f"{what} {path!r} is not a readable file")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ControllerSection(_Section):
    name: str = Field(
        "", description="identity in leader election; empty = host name + pid", validate_default=True
    )
    default_policy: Literal["ntp-pw", "ntp", "dp-drop", "spare"] = "ntp-pw"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    event_log_size: int = Field(1000, ge=10, le=1_000_000)
    plan_history_size: int = Field(100, ge=2, le=100_000)
    flap_hold_down_s: float = Field(
        2.0, ge=0, le=3600,
        description="a recovered GPU is planned again only after this long healthy (doubling per"
        " recent flap, up to 8x; 0 = off; see docs/reliability.md)",
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v:
            v = f"{socket.gethostname().split('.')[0]}-{os.getpid()}"
        if not _NAME.match(v):
            raise ValueError(f"must be 1-63 letters, digits, '.', '_' or '-', got {v!r}")
        return v


class EtcdSection(_Section):
    endpoints: list[str] = Field(default_factory=lambda: ["127.0.0.1:2379"], min_length=1)
    lease_ttl_s: int = Field(5, ge=1, le=300, description="leader-election lease TTL")
    dial_timeout_s: float = Field(2.0, gt=0, le=60)
    username: str = ""
    password_file: str = ""
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    @field_validator("endpoints", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
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
        return self.listen.rsplit(":", 1)[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])


class RestSection(_Listener):
    listen: str = "127.0.0.1:8470"
    admin_tokens_file: str = Field("", description="admin bearer tokens, one per line")
    readonly_tokens_file: str = Field("", description="read-only bearer tokens, one per line")
    protect_reads: bool = Field(False, description="GETs under /v1 need a token of either scope")

    @model_validator(mode="after")
    def _tokens(self) -> RestSection:
        _readable(self.admin_tokens_file, "admin_tokens_file")
        _readable(self.readonly_tokens_file, "readonly_tokens_file")
        return self


class TrainerSection(_Listener):
    listen: str = "127.0.0.1:8471"
    client_ca_file: str = ""
    client_names: list[str] = Field(
        default_factory=list, description="with client_ca_file: accepted certificate CNs; empty = any"
    )
    max_workers: int = Field(64, ge=4, le=4096, description="concurrent RPCs incl. plan streams")

    @field_validator("client_names", mode="before")
    @classmethod
    def _names(cls, v: Any) -> Any:
        return [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _ca(self) -> TrainerSection:
        _readable(self.client_ca_file, "client_ca_file")
        if self.client_ca_file and not self.tls_cert_file:
            raise ValueError("client_ca_file needs tls_cert_file and tls_key_file")
        return self


class AgentsSection(_Section):
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    rpc_timeout_s: float = Field(2.0, gt=0, le=60)

    @model_validator(mode="after")
    def _files(self) -> AgentsSection:
        for name in ("ca_file", "cert_file", "key_file"):
            _readable(getattr(self, name), name)
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("cert_file and key_file go together")
        return self


class TimeoutsSection(_Section):
    agent_lease_ttl_s: float = Field(5, gt=0)
    reaction_bound_s: float = Field(15, gt=0)
    trainer_collective_timeout_s: float = Field(600, gt=0)

    @model_validator(mode="after")
    def _order(self) -> TimeoutsSection:
        if not self.agent_lease_ttl_s < self.reaction_bound_s < self.trainer_collective_timeout_s:
            raise ValueError(
                "need agent_lease_ttl_s < reaction_bound_s < trainer_collective_timeout_s, got "
                f"{self.agent_lease_ttl_s} / {self.reaction_bound_s} / {self.trainer_collective_timeout_s}"
            )
        return self


class ControllerSettings(_Section):
    controller: ControllerSection = Field(default_factory=ControllerSection)
    etcd: EtcdSection = Field(default_factory=EtcdSection)
    rest: RestSection = Field(default_factory=RestSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    agents: AgentsSection = Field(default_factory=AgentsSection)
    timeouts: TimeoutsSection = Field(default_factory=TimeoutsSection)

    @model_validator(mode="after")
    def _within_reaction_bound(self) -> ControllerSettings:
        """A standby takes over within the leader lease TTL + 1 s and a push to an agent
        gives up after rpc_timeout_s: both must fit in the reaction bound."""
        bound = self.timeouts.reaction_bound_s
        if not self.etcd.lease_ttl_s + 1 <= bound:
            raise ValueError(
                f"need etcd.lease_ttl_s + 1 <= timeouts.reaction_bound_s, got {self.etcd.lease_ttl_s} + 1 > {bound}"
            )
        if not self.agents.rpc_timeout_s < bound:
            raise ValueError(
                f"need agents.rpc_timeout_s < timeouts.reaction_bound_s, got {self.agents.rpc_timeout_s} >= {bound}"
            )
        return self


SECTIONS: dict[str, type[_Section]] = {
    name: f.annotation for name, f in ControllerSettings.model_fields.items()  # type: ignore[misc]
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


def _from_env(env: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        section, _, key = name[len(ENV_PREFIX):].lower().partition("__")
        if section not in SECTIONS:
            continue  # another component's section (e.g. the agent's)
        if key not in SECTIONS[section].model_fields:
            raise ConfigError(f"unknown configuration key '{section}.{key}' in environment {name}")
        value: Any = raw
        if raw[:1] in "[{":
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"environment {name} is not valid JSON: {exc}") from exc
        out.setdefault(section, {})[key] = value
    return out


def _merge(*layers: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    for layer in layers:
        for section, values in layer.items():
            merged.setdefault(section, {}).update(values)
    return merged


def load_settings(
    args: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    config_file: str | None = None,
    env: Mapping[str, str] | None = None,
) -> ControllerSettings:
    """Settings from (highest first) ``args`` > ``env`` > the TOML file > defaults.

    ``args`` is ``{section: {key: value}}`` with None values left out."""
    env = os.environ if env is None else env
    path = config_file or env.get(CONFIG_ENV, "")
    file_data = _read_file(path) if path else {}
    arg_data = {s: {k: v for k, v in kv.items() if v is not None} for s, kv in (args or {}).items()}
    _check_keys(arg_data, "command-line arguments")
    env_data = _from_env(env)
    data = _merge(file_data, env_data, arg_data)
    try:
        return ControllerSettings.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first["loc"]]
        where = " " + ".".join(loc) if loc else ""
        origin = _origin(loc[:2], path, file_data, env_data, arg_data)
        raise ConfigError(f"invalid configuration{where} (from {origin}): {first['msg']}") from None


def _origin(loc: list[str], path: str, *layers: Mapping[str, Mapping[str, Any]]) -> str:
    """Where the value at ``loc`` ([section, key], [section] or []) came from."""
    names = (f"config file {path}", "environment", "command-line arguments")
    found = []
    for name, layer in zip(names, layers, strict=True):
        if len(loc) == 2 and loc[1] in layer.get(loc[0], {}):
            found = [f"environment TPFLEX_{loc[0].upper()}__{loc[1].upper()}" if name == "environment" else name]
        elif len(loc) < 2 and any(v for sec, v in layer.items() if not loc or sec == loc[0]):
            found.append(name)
    return ", ".join(found) or "defaults"

