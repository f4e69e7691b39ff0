"""Leader election through an etcd lease, and the fenced session of the elected leader.

The campaign puts ``keys.LEADER`` (a ``LeaderRecord``) bound to a lease, only if the key
does not exist. The winner's writes all go through :class:`LeaderSession`, whose every
transaction also compares the leader key's create-revision with the one the winner created:
once the lease has lapsed (or another process leads), the comparison fails and the write is
refused instead of clobbering the new leader's state (etcd ``concurrency/election.go``).

A leader steps down at once when a keep-alive says the lease is gone, when it could not
refresh the lease for (almost) a whole TTL, or when a fenced write fails on the fence; then
it campaigns again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.backoff import Backoff
from tpflex_proto.etcd import Cmp, Etcd, EtcdError, Op, TxnBuilder, TxnResult
from tpflex_proto.informer import Batch, Informer

log = logging.getLogger(__name__)


# A leader acts only until this fraction of the TTL after its last successful refresh was
# sent: etcd's expiry is at least a full TTL after it received that refresh.
_SAFETY = 0.9


class NotLeader(Exception):
    """This process is not (or no longer) the leader; the write was not made."""


class Conflict(Exception):
    """A compare-and-swap lost: the state in etcd is not the one the write was based on."""


class LeaderSession:
    """The write handle of an elected leader; every write is fenced."""

    def __init__(
        self,
        etcd: Etcd,
        record: types_pb2.LeaderRecord,
        lease_id: int,
        create_revision: int,
        on_lost: Callable[[str], None] | None = None,
        valid_until: float = float("inf"),
    ) -> None:
        self.etcd = etcd
        # monotonic time after which the lease may have lapsed unless refreshed
        self.valid_until = valid_until
        self.record = record
        self.lease_id = lease_id
        self.create_revision = create_revision
        # the fence's compare and its failure branch's read, built once (every commit has them)
        self._fence = Cmp.create_revision(keys.LEADER, "==", create_revision)
        self._read_leader = Op.get(keys.LEADER)
        self._on_lost = on_lost
        self._active = threading.Event()
        self._active.set()

    @property
    def active(self) -> bool:
        if self._active.is_set() and time.monotonic() >= self.valid_until:
            self.deactivate("lease not refreshed within its TTL")
        return self._active.is_set()

    def deactivate(self, why: str) -> None:
        if self._active.is_set():
            self._active.clear()
            log.warning("leader session ended id=%s reason=%s", self.record.id, why)
            if self._on_lost is not None:
                self._on_lost(why)

    def txn(
        self,
        compare: Sequence = (),
        success: Sequence = (),
        failure: Sequence = (),
    ) -> TxnResult:
        """A transaction that only succeeds while this session leads.

        Raises NotLeader (and ends the session) when the fence fails; returns a failed
        TxnResult (``reads`` from ``failure``) when only the caller's comparisons failed.
        """
        if not self.active:
            raise NotLeader("leader session is not active")
        fence = Cmp.create_revision(keys.LEADER, "==", self.create_revision)
        return self._fenced_result(self.etcd.txn([fence, *compare], success, [Op.get(keys.LEADER), *failure]))

    def txn_request(self, txn: TxnBuilder) -> TxnResult:
        """``txn`` of a transaction the caller built, with no failure operations of its
        own: the fence's compare and read are added to it."""
        if not self.active:
            raise NotLeader("leader session is not active")
        if txn.request.failure:
            raise ValueError("txn_request: the fence owns the failure branch")
        txn.compare(self._fence)
        txn.on_failure(self._read_leader)
        return self._fenced_result(self.etcd.txn_request(txn))

    def _fenced_result(self, res: TxnResult) -> TxnResult:
        if res.succeeded:
            return res
        leader = res.reads[0] if res.reads else ()
        if not leader or leader[0].create_revision != self.create_revision:
            self.deactivate("fenced write refused: leader key changed")
            raise NotLeader("fenced write refused: this process no longer leads")
        return TxnResult(False, res.revision, res.reads[1:])

    def put(self, key: str, value: bytes) -> int:
        return self.txn(success=[Op.put(key, value)]).revision

    def delete_keys(self, names: Sequence[str]) -> int:
        return self.txn(success=[Op.delete(k) for k in names]).revision


class Elector:
    """Campaigns for ``keys.LEADER`` and keeps the lease alive while leading.

    ``on_elected(session)`` and ``on_deposed(reason)`` are called from the elector's
    thread; they must not block for long. The leader key's changes (another holder, a
    deletion) come from an informer as a registered handler: the process's shared one
    (``informer``), or else the elector's own informer of the leader key.
    """

    def __init__(
        self,
        etcd: Etcd,
        identity: str,
        *,
        address: str = "",
        ttl: int = 5,
        on_elected: Callable[[LeaderSession], None] = lambda s: None,
        on_deposed: Callable[[str], None] = lambda why: None,
        informer: Informer | None = None,
    ) -> None:
        if ttl < 1:
            raise ValueError("lease TTL must be at least 1 s")
        self.etcd = etcd
        self.identity = identity
        self.address = address
        self.ttl = ttl
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._session: LeaderSession | None = None
        self._last: LeaderSession | None = None  # the latest session, to resume after an outage
        self._thread = threading.Thread(target=self._run, name="elector", daemon=True)
        self._shared = informer
        self._own: Informer | None = None
        self._unregister: Callable[[], None] | None = None
        self.leader_id: str = ""  # last known leader (any process); "" = none known

    @property
    def session(self) -> LeaderSession | None:
        s = self._session
        return s if s is not None and s.active else None

    @property
    def is_leader(self) -> bool:
        return self.session is not None

    def start(self) -> None:
        informer = self._shared
        if informer is None:
            informer = self._own = Informer(self.etcd, keys.LEADER)
        self._unregister = informer.add_handler(self._on_leader_changes)
        if self._own is not None:
            self._own.start()
        self._thread.start()

    def stop(self, *, resign: bool = True) -> None:
        """Stop campaigning; a leader steps down and (``resign``) revokes its lease, so a
        standby takes over at once instead of after the TTL."""
        leading = self.session
        self._stop.set()
        self._wake.set()
        if self._unregister is not None:
            self._unregister()
        if self._own is not None:
            self._own.stop()
        if self._thread.ident is not None:
            self._thread.join(timeout=5)
        if leading is None:
            return
        leading.deactivate("stopping")
        self._on_deposed("stopping")
        if resign:
            try:
                self.etcd.revoke_lease(leading.lease_id)
                log.info("leader resigned id=%s", self.identity)
            except EtcdError as exc:
                log.warning("leader resign failed id=%s error=%s", self.identity, exc)

    # ---- the leader key's changes (an informer's handler) ----

    def _on_leader_changes(self, batch: Batch) -> None:
        for c in batch.changes:
            if c.key != keys.LEADER:
                continue
            s = self._session
            if c.deleted:
                self.leader_id = ""
                if s is not None:
                    s.deactivate("leader key deleted")
            else:
                self.leader_id = c.msg.id if c.msg is not None else "?"  # "?": malformed
                if s is not None and self.leader_id != self.identity:
                    s.deactivate("another process holds the leader key")
        self._wake.set()

    # ---- campaign ----

    def _run(self) -> None:
        backoff = Backoff(0.1, 1.0)
        while not self._stop.is_set():
            try:
                session = self._campaign_once()
                backoff.reset()
            except EtcdError as exc:
                log.info("leader campaign failed id=%s error=%s", self.identity, exc)
                self._stop.wait(backoff.next())
                continue
            if session is None:
                self._wake.wait(max(self.ttl / 3, 0.2))
                self._wake.clear()
                continue
            self._lead(session)

    def _campaign_once(self) -> LeaderSession | None:
        current = self.etcd.get(keys.LEADER)
        if current is not None:
            self._note_leader(current.value)
            return self._resume(current)
        granted = time.monotonic()
        lease = self.etcd.grant_lease(self.ttl)
        record = types_pb2.LeaderRecord(id=self.identity, address=self.address, since=time.time())
        res = self.etcd.txn(
            [Cmp.create_revision(keys.LEADER, "==", 0)],
            [Op.put(keys.LEADER, codec.encode(record), lease=lease)],
            [Op.get(keys.LEADER)],
        )
        if not res.succeeded:
            try:
                self.etcd.revoke_lease(lease)
            except EtcdError:
                pass
            if res.reads and res.reads[0]:
                self._note_leader(res.reads[0][0].value)
            return None
        self.leader_id = self.identity
        log.info("elected leader id=%s revision=%d ttl=%d", self.identity, res.revision, self.ttl)
        return LeaderSession(
            self.etcd,
            record,
            lease,
            res.revision,
            on_lost=self._lost,
            valid_until=granted + self.ttl * _SAFETY,
        )

    def _resume(self, current) -> LeaderSession | None:
        """The key is still ours (we stepped down while etcd was unreachable, but the lease
        survived): refresh the lease and lead again under the same fence."""
        last = self._last
        if last is None or (current.lease, current.create_revision) != (last.lease_id, last.create_revision):
            return None
        sent = time.monotonic()
        if self.etcd.keepalive_once(last.lease_id) <= 0:
            return None
        log.info("leadership resumed id=%s revision=%d", self.identity, last.create_revision)
        return LeaderSession(
            self.etcd,
            last.record,
            last.lease_id,
            last.create_revision,
            on_lost=self._lost,
            valid_until=sent + self.ttl * _SAFETY,
        )

    def _note_leader(self, value: bytes) -> None:
        try:
            self.leader_id = codec.decode(types_pb2.LeaderRecord, value, keys.LEADER).id
        except codec.MalformedValue:
            self.leader_id = "?"

    def _lost(self, why: str) -> None:
        self._wake.set()

    def _lead(self, session: LeaderSession) -> None:
        self._session = self._last = session
        try:
            self._on_elected(session)
        except Exception:
            log.exception("on_elected handler failed id=%s", self.identity)
        self._keep_alive(session)
        self._session = None
        if not self._stop.is_set():
            session.deactivate("lease lost")
            self._on_deposed("lease lost")

    def _keep_alive(self, session: LeaderSession) -> None:
        """Refresh the lease every TTL/3 until it is lost or the elector stops."""
        interval = self.ttl / 3
        while session.active and not self._stop.is_set():
            left = session.valid_until - time.monotonic()
            self._wake.wait(max(0.0, min(interval, left)))
            self._wake.clear()
            if not session.active or self._stop.is_set():
                return
            sent = time.monotonic()
            try:
                remaining = self.etcd.keepalive_once(session.lease_id)
            except EtcdError as exc:
                log.warning("leader keep-alive failed id=%s error=%s", self.identity, exc)
                continue
            if remaining == 0:
                session.deactivate("lease expired")
                return
            session.valid_until = sent + self.ttl * _SAFETY
