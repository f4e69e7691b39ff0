"""A small etcd v3 client behind one narrow interface.

Everything in tpflex that touches etcd goes through :class:`Etcd`. It speaks etcd's own
gRPC API (the generated stubs shipped with ``etcd-sdk-python``), so that timeouts,
multi-endpoint fail-over, TLS, auth and — above all — watches that survive an etcd outage
and resume from the last seen revision are under our control.

Errors are mapped once, here: :class:`EtcdUnavailable` when no endpoint answers in time,
:class:`EtcdCompacted` when a watch asked for a revision etcd has already compacted,
:class:`EtcdError` for anything else.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc
from pyetcd import etcdrpc
from pyetcd.etcdrpc import kv_pb2

from tpflex_proto.backoff import Backoff

log = logging.getLogger(__name__)

_UNAVAILABLE_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
}


class EtcdError(Exception):
    """An etcd request failed; the gRPC cause is kept as ``__cause__``."""


class EtcdUnavailable(EtcdError):
    """No etcd endpoint answered within the timeout."""


class EtcdCompacted(EtcdError):
    """A watch asked for history that etcd has compacted away."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted up to {compact_revision}")
        self.compact_revision = compact_revision


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: str  # "put" or "delete"
    key: str
    value: bytes
    mod_revision: int


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int
    # one entry per Get op in the branch taken: the key-values it read
    reads: tuple[tuple[KeyValue, ...], ...]


# ---- transaction building blocks -------------------------------------------------------


def _prefix_end(prefix: bytes) -> bytes:
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


def _b(s: str | bytes) -> bytes:
    return s if isinstance(s, bytes) else s.encode()


class Cmp:
    """Comparisons for :meth:`Etcd.txn`."""

    @staticmethod
    def _make(key: str, target: int, result: int, **value) -> etcdrpc.Compare:
        return etcdrpc.Compare(key=_b(key), target=target, result=result, **value)

    @staticmethod
    def mod_revision(key: str, op: str, rev: int) -> etcdrpc.Compare:
        return Cmp._make(key, etcdrpc.Compare.MOD, _RESULTS[op], mod_revision=rev)

    @staticmethod
    def create_revision(key: str, op: str, rev: int) -> etcdrpc.Compare:
        """``create_revision(key, "==", 0)`` means "key does not exist"."""
        return Cmp._make(key, etcdrpc.Compare.CREATE, _RESULTS[op], create_revision=rev)

    @staticmethod
    def version(key: str, op: str, version: int) -> etcdrpc.Compare:
        return Cmp._make(key, etcdrpc.Compare.VERSION, _RESULTS[op], version=version)

    @staticmethod
    def value(key: str, op: str, value: bytes) -> etcdrpc.Compare:
        return Cmp._make(key, etcdrpc.Compare.VALUE, _RESULTS[op], value=value)

    @staticmethod
    def prefix_absent(prefix: str) -> etcdrpc.Compare:
        """No key starts with ``prefix`` (an empty range compares as one absent key)."""
        p = _b(prefix)
        return etcdrpc.Compare(key=p, range_end=_prefix_end(p), target=etcdrpc.Compare.CREATE,
                               result=etcdrpc.Compare.EQUAL, create_revision=0)


_RESULTS = {
    "==": etcdrpc.Compare.EQUAL,
    "!=": etcdrpc.Compare.NOT_EQUAL,
    ">": etcdrpc.Compare.GREATER,
    "<": etcdrpc.Compare.LESS,
}


class Op:
    """Operations for :meth:`Etcd.txn`."""

    @staticmethod
    def put(key: str, value: bytes, lease: int = 0) -> etcdrpc.RequestOp:
        return etcdrpc.RequestOp(
            request_put=etcdrpc.PutRequest(key=_b(key), value=value, lease=lease)
        )

    @staticmethod
    def delete(key: str) -> etcdrpc.RequestOp:
        return etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=_b(key)))

    @staticmethod
    def delete_prefix(prefix: str) -> etcdrpc.RequestOp:
        p = _b(prefix)
        return etcdrpc.RequestOp(
            request_delete_range=etcdrpc.DeleteRangeRequest(key=p, range_end=_prefix_end(p))
        )

    @staticmethod
    def get(key: str, *, keys_only: bool = False) -> etcdrpc.RequestOp:
        return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=_b(key), keys_only=keys_only))


class TxnBuilder:
    """One transaction's compares and operations, written into its request in place."""

    __slots__ = ("request",)

    def __init__(self) -> None:
        self.request = etcdrpc.TxnRequest()

    def mod_revision_is(self, key: bytes, revision: int) -> None:
        """``Cmp.mod_revision(key, "==", revision)``."""
        c = self.request.compare.add()
        c.key = key
        c.target = etcdrpc.Compare.MOD
        c.mod_revision = revision  # result EQUAL is the zero value

    def compare(self, cmp: etcdrpc.Compare) -> None:
        self.request.compare.append(cmp)

    def mod_revisions_are(self, pairs: Iterable[tuple[bytes, int]]) -> None:
        """``mod_revision_is(key, revision)`` for each pair, in order."""
        add, mod = self.request.compare.add, etcdrpc.Compare.MOD
        for key, revision in pairs:
            c = add()
            c.key = key
            c.target = mod
            c.mod_revision = revision

    def put(self, key: bytes, value: bytes) -> None:
        """``Op.put(key, value)``."""
        p = self.request.success.add().request_put
        p.key = key
        p.value = value

    def op(self, op: etcdrpc.RequestOp) -> None:
        self.request.success.append(op)

    def ops(self, ops: Iterable[tuple[bytes, bytes] | etcdrpc.RequestOp]) -> None:
        """Each of ``ops`` in order: a ``(key, value)`` pair is ``put(key, value)``, a
        RequestOp goes in as it is."""
        success = self.request.success
        add, append = success.add, success.append
        for op in ops:
            if type(op) is tuple:
                p = add().request_put
                p.key, p.value = op
            else:
                append(op)

    def on_failure(self, op: etcdrpc.RequestOp) -> None:
        self.request.failure.append(op)


def _kv(kv) -> KeyValue:
    return KeyValue(
        key=kv.key.decode(),
        value=bytes(kv.value),
        create_revision=kv.create_revision,
        mod_revision=kv.mod_revision,
        version=kv.version,
        lease=kv.lease,
    )


# ---- the client -------------------------------------------------------------------------


@dataclass(frozen=True)
class EtcdTls:
    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None


class Etcd:
    """A thread-safe etcd v3 client.

    ``endpoints`` are ``host:port`` strings; gRPC fails over between them. Every unary call
    has a deadline of ``timeout`` seconds.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout: float = 2.0,
        user: str | None = None,
        password: str | None = None,
        tls: EtcdTls | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is required")
        self.endpoints = tuple(endpoints)
        self.timeout = timeout
        self._target = "ipv4:" + ",".join(self.endpoints) if len(self.endpoints) > 1 else endpoints[0]
        self._tls = tls
        self._creds = None
        if tls is not None:  # unusable files: refused here, not retried forever as UNAVAILABLE
            from tpflex_proto.tls import ClientCertificateFiles

            # read again when a file changes, for the next channel (a renewed certificate)
            self._creds = ClientCertificateFiles(tls.ca_file, tls.cert_file, tls.key_file)
        self._channel_lock = threading.Lock()
        self._channel_born = 0.0
        self._make_channel()
        self._user, self._password = user, password
        self._token_lock = threading.Lock()
        self._metadata: tuple[tuple[str, str], ...] | None = None
        self._watches: list[Watch] = []
        self._closed = False

    # -- plumbing --

    _OPTIONS = (
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 3_000),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1_000),
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20),
        # this channel's own connections: with gRPC's process-wide subchannel pool, a new
        # channel (``_reset_channel``, or a second client) to the same etcd shares the old
        # one's connection and its reconnect backoff, and fails at once with the last
        # "connection refused" although etcd is back (3 of 8 tries right after an etcd
        # restart in a test here; 0 of 8 with this)
        ("grpc.use_local_subchannel_pool", 1),
    )
    # A channel that has seen etcd go away can sit in reconnect backoff for ~10 s after
    # etcd is back (seen with grpcio 1.76); a fresh channel connects at once. So after an
    # UNAVAILABLE we replace the channel, at most once per this many seconds.
    _CHANNEL_RESET_INTERVAL_S = 0.5
    _OLD_CHANNEL_GRACE_S = 30.0

    def _make_channel(self) -> None:
        if self._creds is not None:
            channel = grpc.secure_channel(self._target, self._creds.get(), options=self._OPTIONS)
        else:
            channel = grpc.insecure_channel(self._target, options=self._OPTIONS)
        self._channel = channel
        self._kv = etcdrpc.KVStub(channel)
        self._lease = etcdrpc.LeaseStub(channel)
        self._watch = etcdrpc.WatchStub(channel)
        self._maint = etcdrpc.MaintenanceStub(channel)
        self._auth = etcdrpc.AuthStub(channel)
        self._channel_born = time.monotonic()

    def _reset_channel(self) -> None:
        """Replace the channel after etcd was unreachable (see _CHANNEL_RESET_INTERVAL_S).
        The old channel is closed only after a grace period: another thread may have taken
        a stub of it a moment ago, and a call on a closed channel raises ValueError rather
        than an RPC error. Calls that fail on it are retried by their callers; watches
        reconnect on the new channel."""
        if self._closed:
            return
        with self._channel_lock:
            if time.monotonic() - self._channel_born < self._CHANNEL_RESET_INTERVAL_S:
                return
            old = self._channel
            self._make_channel()
            self._metadata = None
        closer = threading.Timer(self._OLD_CHANNEL_GRACE_S, old.close)
        closer.daemon = True
        closer.start()

    def _call(self, method, request, *, timeout: float | None = None):
        try:
            try:
                return method(request, timeout=timeout or self.timeout, metadata=self._auth_md())
            except grpc.RpcError as exc:
                if not self._token_rejected(exc):
                    raise
                # etcd's auth token expired (auth-token-ttl) or the member restarted:
                # authenticate again and retry once.
                return method(request, timeout=timeout or self.timeout, metadata=self._auth_md())
        except grpc.RpcError as exc:
            err = _map_error(exc)
            if isinstance(err, EtcdUnavailable):
                self._reset_channel()
            raise err from exc
        except ValueError as exc:  # "Cannot invoke RPC on closed channel!" (client closing)
            raise EtcdUnavailable(f"etcd client channel closed: {exc}") from exc

    def _token_rejected(self, exc: grpc.RpcError) -> bool:
        """True (and the cached token dropped) when etcd refused our auth token."""
        if self._user is None or not hasattr(exc, "code"):
            return False
        if exc.code() != grpc.StatusCode.UNAUTHENTICATED and "invalid auth token" not in (exc.details() or ""):
            return False
        with self._token_lock:
            self._metadata = None
        return True

    def _auth_md(self):
        if self._user is None:
            return None
        with self._token_lock:
            if self._metadata is None:
                try:
                    resp = self._auth.Authenticate(
                        etcdrpc.AuthenticateRequest(name=self._user, password=self._password),
                        timeout=self.timeout,
                    )
                except grpc.RpcError as exc:
                    raise _map_error(exc) from exc
                self._metadata = (("token", resp.token),)
            return self._metadata

    def close(self) -> None:
        self._closed = True
        for w in list(self._watches):
            w.cancel()
        self._channel.close()

    # -- key-value --

    def get(self, key: str) -> KeyValue | None:
        resp = self._call(self._kv.Range, etcdrpc.RangeRequest(key=_b(key)))
        return _kv(resp.kvs[0]) if resp.kvs else None

    def answers(self, key: str, timeout: float) -> int:
        """A linearizable read of ``key`` (one the user may read: with etcd auth, a key
        outside its role is permission denied) within ``timeout``; it needs the raft leader
        and a quorum. The cluster's revision, or EtcdError. A watch that has gone quiet
        cannot tell a quiet cluster from a frozen or leaderless one; this can."""
        resp = self._call(self._kv.Range, etcdrpc.RangeRequest(key=_b(key), keys_only=True, limit=1),
                          timeout=timeout)
        return resp.header.revision

    def get_prefix(self, prefix: str, *, keys_only: bool = False) -> tuple[list[KeyValue], int]:
        """All key-values under ``prefix`` (sorted by key) and the store revision read at."""
        p = _b(prefix)
        req = etcdrpc.RangeRequest(
            key=p,
            range_end=_prefix_end(p),
            keys_only=keys_only,
            sort_order=etcdrpc.RangeRequest.ASCEND,
            sort_target=etcdrpc.RangeRequest.KEY,
        )
        resp = self._call(self._kv.Range, req, timeout=max(self.timeout, 10.0))
        return [_kv(kv) for kv in resp.kvs], resp.header.revision

    def count_prefix(self, prefix: str) -> int:
        """How many keys are under ``prefix`` (etcd counts; nothing is transferred)."""
        p = _b(prefix)
        req = etcdrpc.RangeRequest(key=p, range_end=_prefix_end(p), count_only=True)
        return self._call(self._kv.Range, req).count

    def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        resp = self._call(self._kv.Put, etcdrpc.PutRequest(key=_b(key), value=value, lease=lease))
        return resp.header.revision

    def delete(self, key: str) -> bool:
        resp = self._call(self._kv.DeleteRange, etcdrpc.DeleteRangeRequest(key=_b(key)))
        return resp.deleted > 0

    def delete_prefix(self, prefix: str) -> int:
        p = _b(prefix)
        req = etcdrpc.DeleteRangeRequest(key=p, range_end=_prefix_end(p))
        return self._call(self._kv.DeleteRange, req).deleted

    def txn(
        self,
        compare: Sequence[etcdrpc.Compare],
        success: Sequence[etcdrpc.RequestOp],
        failure: Sequence[etcdrpc.RequestOp] = (),
    ) -> TxnResult:
        return self.txn_request(
            etcdrpc.TxnRequest(compare=list(compare), success=list(success), failure=list(failure)))

    def txn_request(self, txn: TxnBuilder | etcdrpc.TxnRequest) -> TxnResult:
        """``txn`` of a request the caller built (``TxnBuilder``: in place, so that a
        commit of dozens of operations does not build each as a message of its own and
        copy it in)."""
        req = txn.request if isinstance(txn, TxnBuilder) else txn
        resp = self._call(self._kv.Txn, req)
        reads = tuple(
            tuple(_kv(kv) for kv in r.response_range.kvs)
            for r in resp.responses
            if r.WhichOneof("response") == "response_range"
        )
        return TxnResult(resp.succeeded, resp.header.revision, reads)

    # -- leases --

    def grant_lease(self, ttl: int) -> int:
        return self._call(self._lease.LeaseGrant, etcdrpc.LeaseGrantRequest(TTL=ttl)).ID

    def keepalive_once(self, lease_id: int) -> int:
        """Refresh a lease; returns the remaining TTL, 0 when the lease has expired."""
        req = etcdrpc.LeaseKeepAliveRequest(ID=lease_id)
        try:
            for resp in self._lease.LeaseKeepAlive(
                iter([req]), timeout=self.timeout, metadata=self._auth_md()
            ):
                return resp.TTL
        except grpc.RpcError as exc:
            self._token_rejected(exc)  # the next call authenticates again
            err = _map_error(exc)
            if isinstance(err, EtcdUnavailable):
                self._reset_channel()
            raise err from exc
        return 0

    def revoke_lease(self, lease_id: int) -> None:
        try:
            self._call(self._lease.LeaseRevoke, etcdrpc.LeaseRevokeRequest(ID=lease_id))
        except EtcdError as exc:
            if "not found" not in str(exc.__cause__):
                raise

    # -- maintenance --

    def compact(self, revision: int, *, physical: bool = True) -> None:
        """Compact the key-value history up to ``revision`` (watches that start before it
        get a compaction notice and resync)."""
        req = etcdrpc.CompactionRequest(revision=revision, physical=physical)
        self._call(self._kv.Compact, req, timeout=max(self.timeout, 10.0))

    def status(self) -> etcdrpc.StatusResponse:
        return self._call(self._maint.Status, etcdrpc.StatusRequest())

    def healthy(self) -> bool:
        try:
            self.status()
            return True
        except EtcdError:
            return False

    # -- watches --

    def watch_prefix(
        self,
        prefix: str,
        callback: Callable[[list[WatchEvent]], None],
        *,
        start_revision: int = 0,
        on_resync: Callable[[], None] | None = None,
        on_error: Callable[[Exception], None] | None = None,
    ) -> Watch:
        """Deliver every change under ``prefix`` after ``start_revision`` to ``callback``.

        The watch runs on its own thread, reconnects with backoff when etcd goes away, and
        resumes from the revision after the last one delivered, so no event is lost or
        repeated across an outage. If the history it needs was compacted, ``on_resync`` is
        called (the caller must re-read the prefix) and watching continues from now.
        """
        w = Watch(self, _b(prefix), callback, start_revision, on_resync, on_error)
        self._watches.append(w)
        w.start()
        return w


_HAS_LEADER = ("hasleader", "true")  # etcd's rpctypes.MetadataRequireLeaderKey


class Watch:
    """A running watch; see :meth:`Etcd.watch_prefix`."""

    _WORKED_S = 10.0  # established this long: its end starts the back-off over

    def __init__(self, client: Etcd, prefix: bytes, callback, start_revision, on_resync, on_error):
        self._client = client
        self._prefix = prefix
        self._callback = callback
        self._next_rev = start_revision
        self._on_resync = on_resync
        self._on_error = on_error
        self._stop = threading.Event()
        self._requests: queue.Queue = queue.Queue()
        self._call = None
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-watch:{prefix.decode(errors='replace')}", daemon=True
        )
        self.established = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def cancel(self) -> None:
        self._stop.set()
        self._requests.put(None)
        call = self._call
        if call is not None:
            call.cancel()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def _request_iter(self):
        create = etcdrpc.WatchCreateRequest(
            key=self._prefix, range_end=_prefix_end(self._prefix), start_revision=self._next_rev
        )
        yield etcdrpc.WatchRequest(create_request=create)
        while True:
            item = self._requests.get()
            if item is None:
                return
            yield item

    def _run(self) -> None:
        # The back-off starts over after a watch that worked: one that delivered events or
        # stayed established for a while. Not on any response: etcd refuses a watch outside
        # the user's role with one response both created and canceled, and a reset there
        # re-created the watch every 25-50 ms for ever.
        backoff, since = Backoff(0.05, 1.0), None
        while not self._stop.is_set():
            self._requests = queue.Queue()
            try:
                # "hasleader": etcd ends the watch when its member has no raft leader (quorum
                # lost) instead of keeping a stream that delivers nothing, which a reader
                # would take for a quiet, current view
                self._call = self._client._watch.Watch(
                    self._request_iter(), metadata=(*(self._client._auth_md() or ()), _HAS_LEADER)
                )
                for resp in self._call:
                    if resp.compact_revision:
                        raise EtcdCompacted(resp.compact_revision)
                    if resp.canceled:
                        raise EtcdError(f"watch canceled by server: {resp.cancel_reason}")
                    if resp.created:
                        self.established.set()
                        since = time.monotonic()
                    if resp.events:
                        backoff.reset()
                        events = [
                            WatchEvent(
                                "delete" if ev.type == kv_pb2.Event.DELETE else "put",
                                ev.kv.key.decode(),
                                bytes(ev.kv.value),
                                ev.kv.mod_revision,
                            )
                            for ev in resp.events
                        ]
                        self._next_rev = events[-1].mod_revision + 1
                        self._deliver(events)
                if self._stop.is_set():
                    return
                raise EtcdUnavailable("watch stream ended")
            except EtcdCompacted as exc:
                log.warning("etcd watch compacted prefix=%s rev=%d", self._prefix, exc.compact_revision)
                self._next_rev = 0
                if self._on_resync:
                    self._on_resync()
            except (grpc.RpcError, EtcdError, ValueError) as exc:
                # ValueError: a call on a channel closed under us (client closing)
                if self._stop.is_set():
                    return
                if isinstance(exc, ValueError):
                    exc = EtcdUnavailable(f"etcd client channel closed: {exc}")
                self.established.clear()
                if isinstance(exc, grpc.RpcError):
                    self._client._token_rejected(exc)
                err = _map_error(exc) if isinstance(exc, grpc.RpcError) else exc
                if isinstance(err, EtcdUnavailable):
                    self._client._reset_channel()
                log.info("etcd watch interrupted prefix=%s error=%s", self._prefix.decode(), err)
                if self._on_error:
                    self._on_error(err)
                if since is not None and time.monotonic() - since > self._WORKED_S:
                    backoff.reset()  # a quiet watch that had been up a while: no repeat failure
                since = None
                self._stop.wait(backoff.next())
            finally:
                self._requests.put(None)

    def _deliver(self, events: list[WatchEvent]) -> None:
        try:
            self._callback(events)
        except Exception:  # a bad handler must not kill the watch thread
            log.exception("etcd watch callback failed prefix=%s", self._prefix.decode())


def _map_error(exc: grpc.RpcError) -> EtcdError:
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    if code in _UNAVAILABLE_CODES:
        return EtcdUnavailable(f"etcd unavailable: {code.name if code else ''} {detail}")
    return EtcdError(f"etcd error: {code.name if code else ''} {detail}")

