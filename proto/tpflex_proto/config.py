"""Layered service settings shared by the controller and the agent (needs the ``config``
extra: pydantic; ``import tpflex_proto`` does not import this module).

A service declares its schema as a pydantic model whose fields are :class:`Section`s and
calls :func:`load_layers`. Precedence (highest first): command-line argument > environment
``TPFLEX_<SECTION>__<KEY>`` > TOML file > default. Unknown keys are refused, naming the key
and its source; a bad value raises :class:`ConfigError` naming the key and where the value
came from. Secrets are never values: settings hold the paths of files that contain them.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from tpflex_proto import keys

ENV_PREFIX = "TPFLEX_"
ARGS_SOURCE = "command line"
_NAME = keys.NAME_PATTERN

SettingsT = TypeVar("SettingsT", bound=BaseModel)
Layer = Mapping[str, Mapping[str, Any]]


class ConfigError(ValueError):
    """The configuration is unusable; the message names the key and its source."""


def valid_name(value: str) -> str:
    """A name used in etcd keys and records: a node, a rack, a controller identity."""
    if not _NAME.match(value):
        raise ValueError(f"must be 1-63 letters, digits, '.', '_' or '-', got {value!r}")
    return value


def hostport(value: str, what: str) -> str:
    if not keys.hostport_ok(value):
        raise ValueError(f"{what} must be HOST:PORT with a port in 0..65535, got {value!r}")
    return value


def readable(path: str, what: str) -> str:
    if path and (os.path.isdir(path) or not os.access(path, os.R_OK)):
        raise ValueError(f"{what} {path!r} is not a readable file")
    return path


def read_text_file(path: str, what: str) -> str:
    """A small secret or list file as text (UTF-8, surrounding white space removed);
    ValueError naming ``what`` when it cannot be read or is not UTF-8."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ValueError(f"{what} {path!r} cannot be read: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path!r} is not UTF-8 text") from None


def split_list(value: Any) -> Any:
    """A list given as text (environment): a JSON list or comma-separated items."""
    if not isinstance(value, str):
        return value
    if value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON list: {exc}") from exc
    return [p.strip() for p in value.split(",") if p.strip()]


LogLevel = Annotated[
    Literal["DEBUG", "INFO", "WARNING", "ERROR"],
    BeforeValidator(lambda v: v.upper() if isinstance(v, str) else v),
]


class Section(BaseModel):
    # no inf or NaN anywhere: a duration of inf passes a lower bound, then breaks what
    # reads it (the REST child got it back as JSON null and crash-looped)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class EtcdClientSection(Section):
    """How a service reaches etcd; each service chooses the default of ``endpoints``."""

    endpoints: list[str] = Field(default_factory=list)
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
        return split_list(v)

    @field_validator("endpoints")
    @classmethod
    def _endpoints(cls, v: list[str]) -> list[str]:
        return [hostport(re.sub(r"^https?://", "", e), "etcd endpoint") for e in v]

    @model_validator(mode="after")
    def _files(self) -> EtcdClientSection:
        for name in ("password_file", "ca_file", "cert_file", "key_file"):
            readable(getattr(self, name), name)
        if self.username and not self.password_file:
            raise ValueError("username needs password_file")
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("cert_file and key_file go together")
        return self


class Listener(Section):
    """A HOST:PORT a service listens on, with optional TLS (certificate + key files)."""

    listen: str
    tls_cert_file: str = ""
    tls_key_file: str = ""

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        return hostport(v, "listen")

    @model_validator(mode="after")
    def _tls(self):
        readable(self.tls_cert_file, "tls_cert_file")
        readable(self.tls_key_file, "tls_key_file")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together")
        return self

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])


class ClientCaListener(Listener):
    """A TLS listener that may also require client certificates signed by a CA."""

    client_ca_file: str = Field("", description="require client certificates signed by this CA")
    client_names: list[str] = Field(
        default_factory=list, description="with client_ca_file: accepted certificate CNs; empty = any"
    )

    @field_validator("client_names", mode="before")
    @classmethod
    def _names(cls, v: Any) -> Any:
        return split_list(v)

    @model_validator(mode="after")
    def _ca(self):
        readable(self.client_ca_file, "client_ca_file")
        if self.client_ca_file and not self.tls_cert_file:
            raise ValueError("client_ca_file needs tls_cert_file and tls_key_file")
        if self.client_names and not self.client_ca_file:
            # the names are those of client certificates, which only mutual TLS asks for:
            # without a client CA every client would get in, whatever the list says
            raise ValueError("client_names needs client_ca_file (names are checked on client certificates)")
        return self


def _sections(model: type[BaseModel]) -> dict[str, type[BaseModel]]:
    return {name: f.annotation for name, f in model.model_fields.items()}  # type: ignore[misc]


def _check_keys(sections: Mapping[str, type[BaseModel]], data: Mapping[str, Any], where: str) -> None:
    for section, values in data.items():
        if section not in sections or not isinstance(values, dict):
            raise ConfigError(f"unknown configuration key {section!r} in {where}")
        for key in values:
            if key not in sections[section].model_fields:
                raise ConfigError(f"unknown configuration key '{section}.{key}' in {where}")


def _read_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not valid TOML: not UTF-8 text") from None
    except RecursionError:
        raise ConfigError(f"config file {path} is not valid TOML: nested too deeply") from None


def _read_env(sections: Mapping[str, type[BaseModel]], env: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """The service's ``TPFLEX_<SECTION>__<KEY>`` variables, as text; sections of other
    services are skipped, an unknown key in one of ours is refused."""
    out: dict[str, dict[str, str]] = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        section, _, key = name[len(ENV_PREFIX):].lower().partition("__")
        if section not in sections:
            continue
        if key not in sections[section].model_fields:
            raise ConfigError(f"unknown configuration key '{section}.{key}' in environment variable {name}")
        out.setdefault(section, {})[key] = value
    return out


def load_layers(
    model: type[SettingsT], args: Layer, env: Mapping[str, str], config_file: str | None,
) -> SettingsT:
    """``model`` from the TOML file ``config_file`` (or none), ``env`` and ``args``
    (``{section: {key: value}}``, None values left out), merged by precedence and validated.
    Raises :class:`ConfigError` naming each offending key and its source."""
    sections = _sections(model)
    path = config_file or ""
    arg_data = {s: {k: v for k, v in kv.items() if v is not None} for s, kv in args.items()}
    layers = [
        (_read_file(path) if path else {}, f"config file {path}"),
        (_read_env(sections, env), "environment"),
        (arg_data, ARGS_SOURCE),
    ]
    merged: dict[str, dict[str, Any]] = {}
    source: dict[tuple[str, str], str] = {}
    for values, where in layers:
        if where != "environment":
            _check_keys(sections, values, where)
        for section, kv in values.items():
            for k, v in kv.items():
                merged.setdefault(section, {})[k] = v
                source[(section, k)] = f"environment {ENV_PREFIX}{section.upper()}__{k.upper()}" if where == "environment" else where
    try:
        return model.model_validate(merged)
    except ValidationError as exc:
        problems = [_problem(err, source) for err in exc.errors()]
        raise ConfigError("invalid configuration: " + "; ".join(problems)) from None


def _problem(err: Any, source: Mapping[tuple[str, str], str]) -> str:
    """``section.key (from <where the value came from>): message``; a check across keys
    names every source that set keys of the section (or of the whole configuration)."""
    loc = [str(p) for p in err["loc"]]
    if len(loc) >= 2:
        origin = source.get((loc[0], loc[1]), "default")
    else:
        origin = ", ".join(sorted({w for (sec, _), w in source.items() if not loc or sec == loc[0]})) or "default"
    return f"{'.'.join(loc[:2]) or 'settings'} (from {origin}): {err['msg']}"
