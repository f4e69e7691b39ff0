"""What the API needs from the outside, passed in (no import-time singletons), and the
``Annotated`` dependencies the routes declare.

Auth: mutating calls need ``Authorization: Bearer <admin token>``; no or an unknown token
-> 401, a read-only token -> 403. GETs are open unless ``TokenConfig.protect_reads`` is
set, in which case they accept either scope.
"""

from __future__ import annotations

import hmac
import logging
import time
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
from tpflex_controller.api.memo import RenderMemo
from tpflex_controller.api.state import ApiState, EtcdState
from tpflex_controller.steps import StepStats
from tpflex_controller.store import Store

Clock = Callable[[], float]
log = logging.getLogger(__name__)


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


def read_token_file(path: str | Path) -> frozenset[str]:
    """Bearer tokens from a file, one per line; blank lines and ``#`` comments ignored."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise TokenFileError(f"cannot read token file {p}: {reason or exc}") from None
    tokens = {ln.split("#", 1)[0].strip() for ln in lines}
    tokens.discard("")
    for t in tokens:
        if any(c.isspace() for c in t):
            raise TokenFileError(f"token file {p}: a token contains whitespace")
    return frozenset(tokens)


def load_tokens(
    admin_file: str | Path | None = None,
    read_only_file: str | Path | None = None,
    *,
    protect_reads: bool = False,
) -> TokenConfig:
    """The REST tokens, from files only (never the command line), one token per line:
    ``admin_file`` may call every endpoint, ``read_only_file`` GETs (and dry-run) only.
    ``protect_reads``: GETs under /v1 need a token of either scope. A token listed in both
    files is refused (:class:`TokenFileError` naming the files)."""
    admin = read_token_file(admin_file) if admin_file else frozenset()
    read_only = read_token_file(read_only_file) if read_only_file else frozenset()
    if admin & read_only:
        raise TokenFileError(
            f"token files {admin_file} and {read_only_file}: a token is both admin and read-only"
        )
    return TokenConfig(admin=admin, read_only=read_only, protect_reads=protect_reads)


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
    steps: StepStats | None = None  # trainers' step reports on this replica (goodput)
    state: ApiState | None = None  # reads; None = etcd on every request (EtcdState)
    max_in_flight: int = 0  # requests served at once (0 = unbounded); others wait
    busy_wait_s: float = 10.0  # longest wait for a slot before 503 "busy, retry"
    max_body_bytes: int = 1 << 20  # a longer request body is refused (413) unread
    max_bodies: int = 8  # request bodies read at once (memory bound: max_bodies x max_body_bytes)
    body_timeout_s: float = 10.0  # a body must arrive within this (408 otherwise)
    read_your_writes_s: float = 5.0  # a write answers once ``state`` holds it (api/deps.settle)
    response_cache_entries: int = 1024  # rendered GET responses kept (api/respcache.py); 0 = off
    response_cache_bytes: int = 64 << 20  # and at most this many bytes of their bodies
    response_stats: dict[str, int] = field(default_factory=dict)  # the cache's counts (tests)
    memo: RenderMemo = field(default_factory=RenderMemo)  # rendered plans, per job
    # exposition text served ahead of the registry's on /metrics (the REST process: the
    # controller's metrics, passed through unparsed)
    metrics_prefix: Callable[[], bytes] | None = None

    @property
    def reads(self) -> ApiState:
        if self.state is None:
            self.state = EtcdState(self.store)
        return self.state

    def settle(self, revision: int) -> None:
        """Read-your-writes: return once the read view holds etcd ``revision`` (a write
        this request made), so that a client's next GET sees it; at most
        ``read_your_writes_s``. A view still behind then is logged, not an error: the
        write is in etcd and the view follows. Blocks: call from a sync route (a worker
        thread), never on the event loop."""
        if revision <= 0 or self.read_your_writes_s <= 0:
            return
        if not self.reads.wait_revision(revision, self.read_your_writes_s):
            log.warning("the API's view did not reach a write's revision in time revision=%d "
                        "waited_s=%.1f", revision, self.read_your_writes_s)


async def get_deps(request: Request) -> ApiDeps:
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


async def require_admin(
    deps: Deps, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> str:
    if _scope(deps, creds) != "admin":
        raise ApiError(ErrorCode.FORBIDDEN, "this token is read-only; an admin token is required")
    return "admin"


async def require_reader(
    deps: Deps, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> str | None:
    if not deps.tokens.protect_reads:
        return None
    return _scope(deps, creds)


async def require_token(
    deps: Deps, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> str:
    """A known token of either scope, whatever ``protect_reads`` says (the console)."""
    return _scope(deps, creds)


Admin = Annotated[str, Depends(require_admin)]
Scope = Annotated[str, Depends(require_token)]
