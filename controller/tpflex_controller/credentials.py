"""Per-job trainer credentials (docs/deploy.md, "Trust model").

A job credential is a bearer secret bound to one job: ``tpjc:<job>:<name>:<secret>``. The
controller stores only its SHA-256, at ``keys.job_credential(job, name)``; deleting the
job deletes its credentials in the same transaction (``Store.write_spec``), so they die
with it. Issuing a credential under a name that exists replaces the old secret (rotation:
the old one stops working). Every trainer-plane call carries one in the
``authorization: Bearer`` metadata, and :class:`JobAuth` (a server interceptor) lets a
call through only when the job the request names is the credential's job.

What a verification costs: one etcd read per credential per ``ttl_s`` (a positive answer
is cached that long; a miss or a mismatch is always re-read). A revoked credential is
refused at most ``ttl_s`` after its deletion.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.etcd import Cmp, Etcd, EtcdError, Op

from tpflex_controller import audit

log = logging.getLogger(__name__)

PREFIX = "tpjc"
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_SECRET = re.compile(r"[A-Za-z0-9_-]{32,128}")


class CredentialError(ValueError):
    """A credential cannot be issued (the message says why: a bad name, no such job)."""


def name_ok(name: str) -> bool:
    return bool(NAME_PATTERN.fullmatch(name))


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def make_token(job: str, name: str) -> str:
    return f"{PREFIX}:{job}:{name}:{secrets.token_urlsafe(32)}"


def parse_token(token: str) -> tuple[str, str] | None:
    """(job, name) a well-formed job credential claims, or None."""
    parts = token.split(":")
    if len(parts) != 4 or parts[0] != PREFIX:
        return None
    _, job, name, secret = parts
    if not (keys.job_name_ok(job) and name_ok(name) and _SECRET.fullmatch(secret)):
        return None
    return job, name


@dataclass(frozen=True)
class Verified:
    job: str
    name: str

    @property
    def who(self) -> str:
        return f"job:{self.job}/{self.name}"


class Credentials:
    """The job credentials in etcd: issue, list, revoke, verify."""

    def __init__(self, etcd: Etcd, *, ttl_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.etcd, self.ttl_s, self.clock = etcd, ttl_s, clock
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[bytes, float]] = {}

    def issue(self, job: str, name: str, issued_by: str, *, at: float | None = None) -> str:
        """A new secret for credential ``name`` of ``job`` (replacing one of that name),
        written only while the job is registered. Returns the token (shown once)."""
        if not name_ok(name):
            raise CredentialError(f"credential name {name[:80]!r} must be 1-64 letters, digits, "
                                  "'.', '_' or '-', starting with a letter or digit")
        if not keys.job_name_ok(job):
            raise CredentialError(f"job name {job[:80]!r} is not a job name")
        token = make_token(job, name)
        record = types_pb2.JobCredential(job=job, name=name, sha256=digest(token),
                                         issued_at=time.time() if at is None else at,
                                         issued_by=issued_by[:128])
        key = keys.job_credential(job, name)
        done = self.etcd.txn([Cmp.create_revision(keys.job_spec(job), ">", 0)],
                             [Op.put(key, codec.encode(record))])
        if not done.succeeded:
            raise CredentialError(f"job {job!r} is not registered")
        with self._lock:
            self._cache.pop(key, None)
        log.info("job credential issued job=%s name=%s by=%s", job, name, issued_by)
        return token

    def list(self, job: str) -> list[types_pb2.JobCredential]:
        out = []
        for kv in self.etcd.get_prefix(keys.job_credentials(job))[0]:
            try:
                out.append(codec.decode(types_pb2.JobCredential, kv.value, kv.key))
            except codec.MalformedValue as exc:
                log.warning("skipping malformed etcd value key=%s error=%s", kv.key, exc)
        return sorted(out, key=lambda c: c.name)

    def revoke(self, job: str, name: str) -> bool:
        key = keys.job_credential(job, name)
        with self._lock:
            self._cache.pop(key, None)
        return bool(self.etcd.delete(key))

    def verify(self, token: str) -> Verified | None:
        """The job and name of a valid credential, or None (malformed, unknown, revoked)."""
        claim = parse_token(token)
        if claim is None:
            return None
        key = keys.job_credential(*claim)
        want = digest(token)
        now = self.clock()
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None and now - hit[1] < self.ttl_s and hmac.compare_digest(hit[0], want):
            return Verified(*claim)
        kv = self.etcd.get(key)
        if kv is None:
            return None
        try:
            stored = codec.decode(types_pb2.JobCredential, kv.value, kv.key)
        except codec.MalformedValue:
            return None
        if not hmac.compare_digest(stored.sha256, want):
            return None
        with self._lock:
            if len(self._cache) > 65536:
                self._cache.clear()
            self._cache[key] = (stored.sha256, now)
        return Verified(*claim)


# ---------------------------------------------------------------- the server's check

@dataclass(frozen=True)
class Caller:
    """Who made the current trainer-plane call (set by :class:`JobAuth` for the handler)."""

    who: str
    job: str = ""                  # the credential's job ("" for an operator)
    operator: str = ""             # the admin token's name, for RegisterJob
    request_id: str = ""           # the call's x-request-id (or a fresh one)


CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("tpflex_caller", default=None)

# the job each trainer-plane request names (full method name -> extractor)
_TRAINER = "/tpflex.v1.Trainer/"
_RDZV = "/tpflex.v1.Rendezvous/"
JOB_OF: dict[str, Callable[[object], str]] = {
    _TRAINER + "RegisterJob": lambda r: r.spec.name,
    _TRAINER + "WatchPlan": lambda r: r.job,
    _TRAINER + "AckPlan": lambda r: r.job,
    _TRAINER + "ReportStep": lambda r: r.job,
    _TRAINER + "ReportRankExit": lambda r: r.job,
    **{_RDZV + m: (lambda r: r.job) for m in (
        "Set", "Get", "Add", "Check", "Wait", "CompareSet", "DeleteKey", "DeletePrefix",
        "NumKeys", "KeepAlive")},
}
STREAMED = {_TRAINER + "Heartbeat"}  # the job is in each streamed message (Beat.job)

AdminCheck = Callable[[str, str], "str | None"]  # (token, job) -> operator name, or None


class JobAuth(grpc.ServerInterceptor):
    """Lets a trainer-plane call through only with a credential of the job it names:
    UNAUTHENTICATED without a valid credential (none, malformed, unknown, revoked),
    PERMISSION_DENIED with another job's. ``RegisterJob`` also accepts an admin token
    (``admin_check``): an operator registering a job and being issued its credential.
    A method this table does not know is refused. Every refusal is an audit line."""

    def __init__(self, credentials: Credentials, admin_check: AdminCheck | None = None) -> None:
        self.credentials = credentials
        self.admin_check = admin_check or (lambda token, job: None)
        self.refused = 0

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        token = _bearer(handler_call_details.invocation_metadata)
        rid = _request_id(handler_call_details.invocation_metadata)
        service, _, name = method.rpartition("/")
        what = service.rsplit(".", 1)[-1].lower() + "." + name
        if method in STREAMED:
            return _wrap_stream(handler, lambda job: self._decide(what, token, job, rid),
                                self._refuse)
        extract = JOB_OF.get(method)
        if extract is None:
            refusal = _Refusal(what, "anonymous", "", rid, grpc.StatusCode.PERMISSION_DENIED,
                               f"{method} is not a trainer-plane call this controller authorises")
            return _wrap_unary(handler, lambda request: refusal, self._refuse)
        register = method.endswith("/RegisterJob")
        return _wrap_unary(
            handler, lambda request: self._decide(what, token, extract(request), rid, register=register),
            self._refuse)

    def _decide(self, what: str, token: str, job: str, rid: str, *,
                register: bool = False) -> Caller | _Refusal:
        try:
            verified = self.credentials.verify(token) if token else None
        except EtcdError as exc:  # not a refusal: the caller retries (another replica)
            return _Refusal(what, "", job, rid, grpc.StatusCode.UNAVAILABLE, f"etcd unavailable: {exc}")
        if verified is not None:
            if verified.job == job:
                return Caller(who=verified.who, job=verified.job, request_id=rid)
            return _Refusal(what, verified.who, job, rid, grpc.StatusCode.PERMISSION_DENIED,
                            f"this credential is job {verified.job!r}'s, not job {job[:128]!r}'s")
        if register and token:
            operator = self.admin_check(token, job)
            if operator is not None:
                return Caller(who=f"operator:{operator}", operator=operator, request_id=rid)
        if not token:
            reason = ("no job credential (send 'authorization: Bearer <job credential>'; tpflex-run "
                      "hands its ranks TPFLEX_JOB_CREDENTIAL_FILE)")
        elif parse_token(token):
            reason = "unknown or revoked job credential"
        else:
            reason = "not a job credential" + (
                " or an admin token allowed to register this job" if register else "")
        return _Refusal(what, "anonymous", job, rid, grpc.StatusCode.UNAUTHENTICATED, reason)

    def _refuse(self, ctx, r: _Refusal) -> None:
        if r.code == grpc.StatusCode.UNAVAILABLE:
            ctx.abort(r.code, r.message)
        self.refused += 1
        audit.record(who=r.who, what=r.what, target=f"job:{r.job[:128]}", outcome="denied",
                     request_id=r.request_id, reason=r.message, peer=ctx.peer())
        log.warning("trainer call refused what=%s who=%s job=%s code=%s", r.what, r.who,
                    r.job[:128], r.code.name)
        ctx.abort(r.code, r.message)


@dataclass(frozen=True)
class _Refusal:
    what: str
    who: str
    job: str
    request_id: str
    code: grpc.StatusCode
    message: str


def _bearer(metadata) -> str:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()[:512]
    return ""


def _request_id(metadata) -> str:
    for key, value in metadata or ():
        if key == "x-request-id" and isinstance(value, str):
            clean = re.sub(r"[^A-Za-z0-9._-]", "", value)[:64]
            if clean:
                return clean
    return audit.request_id()


@contextlib.contextmanager
def _as_caller(decide, refuse, request, context):
    """Decide on ``request``: a refusal aborts the call; a caller is :data:`CALLER` inside."""
    caller = decide(request)
    if isinstance(caller, _Refusal):
        refuse(context, caller)
    reset = CALLER.set(caller)
    try:
        yield
    finally:
        CALLER.reset(reset)


def _wrap_unary(handler: grpc.RpcMethodHandler, decide, refuse) -> grpc.RpcMethodHandler:
    """``handler`` with ``decide(request)`` first: a refusal aborts the call, a caller is
    set in :data:`CALLER` while the servicer runs."""
    kinds = (("unary_unary", grpc.unary_unary_rpc_method_handler),
             ("unary_stream", grpc.unary_stream_rpc_method_handler),
             ("stream_unary", grpc.stream_unary_rpc_method_handler),
             ("stream_stream", grpc.stream_stream_rpc_method_handler))
    for attr, make in kinds:
        behaviour = getattr(handler, attr)
        if behaviour is None:
            continue
        if attr.startswith("stream_"):  # client-streamed without an extractor: refused
            def guarded(request_iterator, context):
                refuse(context, decide(None))
        elif attr == "unary_stream":
            def guarded(request, context, _behaviour=behaviour):
                with _as_caller(decide, refuse, request, context):
                    yield from _behaviour(request, context)
        else:
            def guarded(request, context, _behaviour=behaviour):
                with _as_caller(decide, refuse, request, context):
                    return _behaviour(request, context)
        return make(guarded, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)
    return handler


def _wrap_stream(handler: grpc.RpcMethodHandler, decide, refuse) -> grpc.RpcMethodHandler:
    """A client-streamed method (``Heartbeat``): every message's ``job`` is checked before
    the servicer sees it; the first refused one ends the stream there, and the call is
    refused once the servicer returns."""
    behaviour = handler.stream_unary

    def guarded(request_iterator, context):
        refused: list[_Refusal] = []

        def checked() -> Iterator:
            for message in request_iterator:
                caller = decide(message.job)
                if isinstance(caller, _Refusal):
                    refused.append(caller)
                    return
                yield message

        result = behaviour(checked(), context)
        if refused:
            refuse(context, refused[0])
        return result

    return grpc.stream_unary_rpc_method_handler(
        guarded, request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer)
