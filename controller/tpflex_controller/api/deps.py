"""What the API needs from the outside, passed in (no import-time singletons), and the
``Annotated`` dependencies the routes declare.

Auth: mutating calls need ``Authorization: Bearer <admin token>``; no or an unknown token
-> 401, a read-only token -> 403. GETs are open unless ``TokenConfig.protect_reads`` is
set, in which case they accept either scope.
"""

from __future__ import annotations

import hmac
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry
from tpflex_proto.etcd import Etcd
from tpflex_proto.powermodel import PowerModel

from tpflex_controller.api.errors import ApiError, ErrorCode
from tpflex_controller.store import Store

Clock = Callable[[], float]


class TokenFileError(ValueError):
    """The token file cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class TokenConfig:
    admin: frozenset[str] = frozenset()
    read_only: frozenset[str] = frozenset()
    protect_reads: bool = False  # True: GETs under /v1 need a token of either scope

    def scope_of(self, token: str) -> str | None:
        """"admin", "read-only" or None; compares in constant time per token."""
        found = None
        for scope, tokens in (("admin", self.admin), ("read-only", self.read_only)):
            for known in tokens:
                if hmac.compare_digest(known.encode(), token.encode()):
                    found = found or scope
        return found


_TOKEN_KEYS = {"admin", "read_only", "protect_reads"}


def load_tokens(path: str | Path) -> TokenConfig:
    """Read the REST tokens from a TOML file::

        admin = ["<token>", ...]       # may call every endpoint
        read_only = ["<token>", ...]   # may call GETs only
        protect_reads = false          # true: GETs need a token too

    Tokens come from a file only, never from the command line.
    """
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except OSError as exc:
        raise TokenFileError(f"cannot read token file {p}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise TokenFileError(f"token file {p} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - _TOKEN_KEYS)
    if unknown:
        raise TokenFileError(f"token file {p}: unknown key {unknown[0]!r}; expected {sorted(_TOKEN_KEYS)}")
    scopes = {name: _token_set(p, name, data.get(name, [])) for name in ("admin", "read_only")}
    both = scopes["admin"] & scopes["read_only"]
    if both:
        raise TokenFileError(f"token file {p}: a token is listed as both admin and read_only")
    protect = data.get("protect_reads", False)
    if not isinstance(protect, bool):
        raise TokenFileError(f"token file {p}: protect_reads must be true or false")
    return TokenConfig(admin=scopes["admin"], read_only=scopes["read_only"], protect_reads=protect)


def _token_set(path: Path, name: str, value: object) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise TokenFileError(f"token file {path}: {name} must be a list of strings")
    tokens = [t.strip() for t in value]
    if any(not t or any(c.isspace() for c in t) for t in tokens):
        raise TokenFileError(f"token file {path}: {name} has an empty token or one with spaces")
    return frozenset(tokens)


@dataclass
class ApiDeps:
    """Everything the REST API touches, built by whoever serves it."""

    store: Store
    etcd: Etcd
    tokens: TokenConfig
    registry: CollectorRegistry
    clock: Clock = time.time
    power_model: PowerModel | None = None  # None = the planner's default table
    planner: Callable | None = field(default=None)  # None = tpflex_controller.planner.plan


def get_deps(request: Request) -> ApiDeps:
    return request.app.state.deps


Deps = Annotated[ApiDeps, Depends(get_deps)]

_bearer = HTTPBearer(auto_error=False, description="admin token (mutations) or read-only token")


def _scope(deps: ApiDeps, creds: HTTPAuthorizationCredentials | None) -> str:
    if creds is None or creds.scheme.lower() != "bearer" or not creds.credentials:
        raise ApiError(ErrorCode.UNAUTHORIZED, "missing bearer token: send 'Authorization: Bearer <token>'")
    scope = deps.tokens.scope_of(creds.credentials)
    if scope is None:
        raise ApiError(ErrorCode.UNAUTHORIZED, "unknown bearer token")
    return scope


def require_admin(
    deps: Deps, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> str:
    if _scope(deps, creds) != "admin":
        raise ApiError(ErrorCode.FORBIDDEN, "this token is read-only; an admin token is required")
    return "admin"


def require_reader(
    deps: Deps, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> str | None:
    if not deps.tokens.protect_reads:
        return None
    return _scope(deps, creds)


Admin = Annotated[str, Depends(require_admin)]
