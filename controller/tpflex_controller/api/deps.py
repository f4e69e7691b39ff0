"""What the API needs from the outside, passed in (no import-time singletons), and the
``Annotated`` dependencies the routes declare.

Auth: mutating calls need ``Authorization: Bearer <admin token>``; no or an unknown token
-> 401, a read-only token -> 403. GETs are open unless ``TokenConfig.protect_reads`` is
set, in which case they accept either scope.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
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
from tpflex_controller.api.params import JOB_PATTERN, NAME_PATTERN
from tpflex_controller.api.state import ApiState, EtcdState
from tpflex_controller.steps import StepStats
from tpflex_controller.store import Store

Clock = Callable[[], float]
log = logging.getLogger(__name__)


class TokenFileError(ValueError):
    """The token file cannot be used; the message names the file and the problem (and the
    line, never the token)."""


NAME_RE = re.compile(r"[A-Za-z0-9._@-]{1,64}")
_LIMIT_RE = re.compile(r"(jobs|racks)=(.*)")
_JOB_RE = re.compile(JOB_PATTERN)
_RACK_RE = re.compile(NAME_PATTERN)
ADMIN, READ_ONLY = "admin", "read-only"


def anonymous_name(token: str) -> str:
    """The name of a token listed without one: ``token-`` + the first 8 hex digits of its
    SHA-256 (identifies it in logs without revealing it)."""
    return "token-" + hashlib.sha256(token.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class Caller:
    """Who made a request: the token's name, its scope (``admin`` or ``read-only``) and,
    for an admin token, the jobs and racks it is limited to (None: not limited). A token
    with any limit may change only what its limits name: ``jobs=`` only -> those jobs'
    spec and overrides, no rack or GPU; ``racks=`` only -> those racks' records and their
    GPUs' drains, no job."""

    name: str
    scope: str
    jobs: frozenset[str] | None = None
    racks: frozenset[str] | None = None

    @property
    def limited(self) -> bool:
        return self.jobs is not None or self.racks is not None

    def may_change_job(self, job: str) -> bool:
        return not self.limited or (self.jobs is not None and job in self.jobs)

    def may_change_rack(self, rack: str | None) -> bool:
        return not self.limited or (self.racks is not None and rack in self.racks)


@dataclass(frozen=True)
class TokenEntry:
    """One line of a token file (``repr`` leaves the token out)."""

    name: str
    token: str = field(repr=False)
    jobs: frozenset[str] | None = None
    racks: frozenset[str] | None = None
    line: int = 0


@dataclass(frozen=True)
class TokenConfig:
    admin_entries: tuple[TokenEntry, ...] = ()
    read_only_entries: tuple[TokenEntry, ...] = ()
    protect_reads: bool = False  # True: GETs under /v1 need a token of either scope

    @property
    def admin(self) -> frozenset[str]:
        return frozenset(e.token for e in self.admin_entries)

    @property
    def read_only(self) -> frozenset[str]:
        return frozenset(e.token for e in self.read_only_entries)

    def caller_of(self, token: str) -> Caller | None:
        """The caller a bearer token stands for, or None. Compares with every known token
        in constant time (no early exit: the time does not tell which one matched)."""
        found = None
        presented = token.encode()
        for scope, entries in ((ADMIN, self.admin_entries), (READ_ONLY, self.read_only_entries)):
            for e in entries:
                if hmac.compare_digest(e.token.encode(), presented) and found is None:
                    found = Caller(e.name, scope, e.jobs, e.racks)
        return found

    scope_of = caller_of  # the caller (its ``scope``: "admin" or "read-only"), or None


def _limit(path: Path, n: int, kind: str, value: str) -> frozenset[str]:
    names = value.split(",")
    pattern = _JOB_RE if kind == "jobs" else _RACK_RE
    if not value or not all(pattern.fullmatch(x) for x in names):
        raise TokenFileError(f"token file {path} line {n}: {kind}= needs a comma-separated list of "
                             f"{kind[:-1]} names")
    return frozenset(names)


def parse_token_line(path: Path, n: int, line: str) -> TokenEntry | None:
    """One line: ``[<name>] <token> [jobs=a,b] [racks=r1,r2]``; None for a blank line or a
    comment. Errors name the file and line, never the token."""
    fields = line.split("#", 1)[0].split()
    if not fields:
        return None
    limits: dict[str, frozenset[str]] = {}
    while len(fields) > 1 and (m := _LIMIT_RE.fullmatch(fields[-1])):
        kind, value = m.groups()
        if kind in limits:
            raise TokenFileError(f"token file {path} line {n}: {kind}= given twice")
        limits[kind] = _limit(path, n, kind, value)
        fields.pop()
    if len(fields) == 1:
        token = fields[0]
        name = anonymous_name(token)
    elif len(fields) == 2:
        name, token = fields
        if not NAME_RE.fullmatch(name):
            raise TokenFileError(f"token file {path} line {n}: a token's name is 1-64 of "
                                 "A-Z a-z 0-9 . _ @ - (the line is '<name> <token> [jobs=a,b] [racks=r1,r2]')")
    else:
        raise TokenFileError(f"token file {path} line {n}: expected '<name> <token> "
                             "[jobs=a,b] [racks=r1,r2]' or a bare token (a token contains no whitespace)")
    if _LIMIT_RE.fullmatch(token):
        raise TokenFileError(f"token file {path} line {n}: no token, only limits")
    return TokenEntry(name, token, limits.get("jobs"), limits.get("racks"), n)


def read_token_entries(path: str | Path) -> tuple[TokenEntry, ...]:
    """The tokens of a token file, one per line (``parse_token_line``); blank lines and
    ``#`` comments ignored. A name or a token given twice is refused."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise TokenFileError(f"cannot read token file {p}: {reason or exc}") from None
    entries: list[TokenEntry] = []
    for n, line in enumerate(lines, 1):
        entry = parse_token_line(p, n, line)
        if entry is not None:
            entries.append(entry)
    _check_unique(entries, where=lambda e: f"token file {p} line {e.line}")
    return tuple(entries)


def _check_unique(entries: list[TokenEntry], *, where: Callable[[TokenEntry], str]) -> None:
    """No name and no token twice; ``where(entry)`` says where an entry is."""
    names: dict[str, TokenEntry] = {}
    tokens: dict[str, TokenEntry] = {}
    for e in entries:
        if e.name in names:
            raise TokenFileError(f"token name {e.name!r} is used twice: {where(names[e.name])} and "
                                 f"{where(e)} (names identify callers in logs and records)")
        if e.token in tokens:
            raise TokenFileError(f"the same token is listed twice: {where(tokens[e.token])} and {where(e)}")
        names[e.name], tokens[e.token] = e, e


def read_token_file(path: str | Path) -> frozenset[str]:
    """The bearer tokens of a file (``read_token_entries`` without names)."""
    return frozenset(e.token for e in read_token_entries(path))


def load_tokens(
    admin_file: str | Path | None = None,
    read_only_file: str | Path | None = None,
    *,
    protect_reads: bool = False,
) -> TokenConfig:
    """The REST tokens, from files only (never the command line), one token per line
    (``[<name>] <token> [jobs=a,b] [racks=r1,r2]``): ``admin_file`` may call every
    endpoint (within its limits), ``read_only_file`` GETs (and dry-run) only.
    ``protect_reads``: GETs under /v1 need a token of either scope. A token or a name
    listed in both files, or limits on a read-only token, are refused
    (:class:`TokenFileError` naming the files and lines)."""
    admin = read_token_entries(admin_file) if admin_file else ()
    read_only = read_token_entries(read_only_file) if read_only_file else ()
    for e in read_only:
        if e.jobs is not None or e.racks is not None:
            raise TokenFileError(f"token file {read_only_file} line {e.line}: jobs=/racks= limits "
                                 "are for admin tokens (a read-only token changes nothing)")
    if set(e.token for e in admin) & set(e.token for e in read_only):
        raise TokenFileError(
            f"token files {admin_file} and {read_only_file}: a token is both admin and read-only"
        )
    files = {id(e): admin_file for e in admin} | {id(e): read_only_file for e in read_only}
    _check_unique([*admin, *read_only], where=lambda e: f"{files[id(e)]} line {e.line}")
    return TokenConfig(admin_entries=admin, read_only_entries=read_only, protect_reads=protect_reads)


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


def _caller(deps: ApiDeps, creds: HTTPAuthorizationCredentials | None) -> Caller:
    if creds is None or creds.scheme.lower() != "bearer" or not creds.credentials:
        raise ApiError(ErrorCode.UNAUTHORIZED, "missing bearer token: send 'Authorization: Bearer <token>'")
    caller = deps.tokens.caller_of(creds.credentials)
    if caller is None:
        raise ApiError(ErrorCode.UNAUTHORIZED, "unknown bearer token")
    return caller


async def require_admin(
    deps: Deps, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Caller:
    caller = _caller(deps, creds)
    if caller.scope != ADMIN:
        raise ApiError(ErrorCode.FORBIDDEN, "this token is read-only; an admin token is required")
    return caller


async def require_reader(
    deps: Deps, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Caller | None:
    if not deps.tokens.protect_reads:
        return None
    return _caller(deps, creds)


async def require_token(
    deps: Deps, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Caller:
    """A known token of either scope, whatever ``protect_reads`` says (the console)."""
    return _caller(deps, creds)


def check_job_limit(caller: Caller, job: str) -> None:
    """403 unless ``caller`` may change ``job`` (its token's ``jobs=`` limit)."""
    if not caller.may_change_job(job):
        raise ApiError(ErrorCode.FORBIDDEN, f"token {caller.name!r} may not change job {job!r}: "
                       f"it is limited to {_limits(caller)}")


def check_rack_limit(caller: Caller, rack: str | None, what: str) -> None:
    """403 unless ``caller`` may change ``rack`` (its token's ``racks=`` limit); ``what``
    names the target (``rack 'r1'``, ``GPU n1:3 (rack 'r1')``)."""
    if not caller.may_change_rack(rack):
        raise ApiError(ErrorCode.FORBIDDEN, f"token {caller.name!r} may not change {what}: "
                       f"it is limited to {_limits(caller)}")


def _limits(caller: Caller) -> str:
    parts = [f"{kind} {', '.join(sorted(names))}" for kind, names in
             (("jobs", caller.jobs), ("racks", caller.racks)) if names is not None]
    return " and ".join(parts)


Admin = Annotated[Caller, Depends(require_admin)]
Scope = Annotated[Caller, Depends(require_token)]
