"""The REST API's read-only view of ``/tpflex/v1/``, fed by its own etcd prefix watch.

REST reads are served from memory: no etcd round trip per request, and a one-object read
costs O(that object) (per-key dicts, a node -> rack index), a list read O(its result).
The watch thread folds events under a lock held only for the dict updates; readers take
the same lock for a lookup or a shallow dict copy (C speed) and never mutate what they get
(stored protobufs are shared, treat them as read-only).

Until the first full read, and while the watch is disconnected from etcd, reads raise a
503 (``ETCD_UNAVAILABLE``) with a message; the watch resumes from the next revision, so
nothing is lost across an outage. A compacted history triggers a full re-read.
"""

from __future__ import annotations

import logging
import threading

from tpflex_proto import keys, types_pb2
from tpflex_proto.etcd import Etcd, EtcdError, KeyValue, Watch, WatchEvent
from tpflex_proto.keys import Kind as KeyKind

from tpflex_controller.api.errors import ApiError, ErrorCode
from tpflex_controller.api.feed import Change, Handler, Kind, Subscribers, Unsubscribe, classify
from tpflex_controller.store import Snapshot, Store, apply_kv, decode_or_skip

log = logging.getLogger(__name__)



class _Tables:
    """Everything the API reads, keyed for O(1) lookups; mutated only by the feeder."""

    def __init__(self, revision: int = 0) -> None:
        self.snap = Snapshot(revision=revision)
        self.node_rack: dict[str, str] = {}  # rack members -> rack (registrations add theirs)
        self.node_overrides: dict[str, set[int]] = {}  # node -> GPU indices with an override
        self.acks: dict[str, dict[int, types_pb2.Ack]] = {}
        self.events: dict[int, types_pb2.Event] = {}
        self.leader: types_pb2.LeaderRecord | None = None
        self.leader_present = False

    def fold(self, kv: KeyValue, deleted: bool) -> None:
        k = keys.parse(kv.key)
        kind = k.kind if k is not None else None
        if kind is KeyKind.LEADER:
            self._fold_leader(kv, deleted)
        elif kind is KeyKind.EVENT:
            _fold_int(self.events, k.number, types_pb2.Event, kv, deleted)
        elif kind is KeyKind.RACK:
            old = self.snap.racks.get(k.name)
            apply_kv(self.snap, kv, deleted)
            self._index_rack(k.name, old)
        elif kind is KeyKind.GPU_OVERRIDE:
            apply_kv(self.snap, kv, deleted)
            self._index_override(k.name, k.number)
        elif kind is KeyKind.JOB_ACK:
            _fold_int(self.acks.setdefault(k.name, {}), k.number, types_pb2.Ack, kv, deleted)
        elif k is None and not deleted and (kv.key.startswith(keys.EVENTS) or "/acks/" in kv.key):
            log.warning("skipping malformed etcd key key=%s", kv.key)
        else:
            apply_kv(self.snap, kv, deleted)

    def _fold_leader(self, kv: KeyValue, deleted: bool) -> None:
        self.leader_present = not deleted
        self.leader = None if deleted else decode_or_skip(types_pb2.LeaderRecord, kv)
        if self.leader_present and self.leader is None:  # unreadable, but a leader is elected
            self.leader = types_pb2.LeaderRecord(id="<unreadable>")

    def _index_rack(self, name: str, old: types_pb2.Rack | None) -> None:
        for n in old.nodes if old is not None else ():
            if self.node_rack.get(n) == name:
                del self.node_rack[n]
        new = self.snap.racks.get(name)
        for n in new.nodes if new is not None else ():
            self.node_rack[n] = name

    def _index_override(self, node: str, index: int) -> None:
        if (node, index) in self.snap.gpu_overrides:
            self.node_overrides.setdefault(node, set()).add(index)
        else:
            self.node_overrides.get(node, set()).discard(index)


def _fold_int(table: dict, number: int, cls, kv: KeyValue, deleted: bool) -> None:
    if deleted:
        table.pop(number, None)
        return
    msg = decode_or_skip(cls, kv)
    if msg is not None:
        table[number] = msg


def node_subset(snap: Snapshot, node: str, rack: types_pb2.Rack | None,
                override_indices: set[int]) -> Snapshot:
    """The part of ``snap`` one node's views need: its rack, registration, health and
    GPU overrides (GPU states depend only on the node's own records)."""
    out = Snapshot(revision=snap.revision)
    if rack is not None:
        out.racks[rack.name] = rack
    for src, dst in ((snap.nodes, out.nodes), (snap.health, out.health)):
        if node in src:
            dst[node] = src[node]
    for idx in override_indices:
        o = snap.gpu_overrides.get((node, idx))
        if o is not None:
            out.gpu_overrides[(node, idx)] = o
    return out


class ApiStateCache:
    """``start()`` reads ``/tpflex/v1/`` once (retrying while etcd is away) and watches it;
    ``stop()`` cancels the watch. Read methods raise ApiError(503) until synced.
    ``subscribe(handler)``: the :class:`tpflex_controller.api.feed.ChangeFeed` of what it
    folds (live views such as the console's stream)."""

    def __init__(self, etcd: Etcd, *, retry_s: float = 0.5) -> None:
        self.etcd = etcd
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._t = _Tables()
        self._synced = False
        self._watch: Watch | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._subscribers = Subscribers()

    def subscribe(self, handler: Handler) -> Unsubscribe:
        return self._subscribers.subscribe(handler)

    # ---- lifecycle ----

    def start(self) -> ApiStateCache:
        self._thread = threading.Thread(target=self._sync_loop, name="api-cache-sync", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._watch is not None:
            self._watch.cancel()

    def _sync_loop(self) -> None:
        while not self._stop.is_set():
            try:
                rev = self._reread()
            except EtcdError as exc:
                log.info("api cache cannot read etcd; retrying error=%s", exc)
                self._stop.wait(self._retry_s)
                continue
            self._watch = self.etcd.watch_prefix(
                keys.PREFIX, self._on_events, start_revision=rev + 1, on_resync=self._on_resync
            )
            while not self._watch.established.wait(self._retry_s):
                if self._stop.is_set():
                    return
            with self._changed:
                self._synced = True
                self._changed.notify_all()
            log.info("api cache synced revision=%d", rev)
            return

    def _reread(self) -> int:
        kvs, rev = self.etcd.get_prefix(keys.PREFIX)
        tables = _Tables(rev)
        for kv in kvs:
            tables.fold(kv, False)
        with self._changed:
            self._t = tables
            self._changed.notify_all()
        self._subscribers.publish([Change(Kind.RESYNC, "", rev)])
        return rev

    def _on_resync(self) -> None:
        log.warning("api cache history compacted: re-reading state")
        while not self._stop.is_set():
            try:
                rev = self._reread()
            except EtcdError as exc:
                log.info("api cache cannot re-read etcd; retrying error=%s", exc)
                self._stop.wait(self._retry_s)
                continue
            if self._watch is not None:  # resume right after the re-read, not "from now"
                self._watch._next_rev = rev + 1
            return

    def _on_events(self, events: list[WatchEvent]) -> None:
        with self._changed:
            t = self._t
            for ev in events:
                kv = KeyValue(ev.key, ev.value, 0, ev.mod_revision, 0, 0)
                t.fold(kv, ev.kind == "delete")
            t.snap.revision = max(t.snap.revision, events[-1].mod_revision)
            self._changed.notify_all()
        if len(self._subscribers):
            self._subscribers.publish(
                [classify(ev.key, ev.mod_revision, ev.kind == "delete") for ev in events]
            )

    # ---- state ----

    @property
    def ready(self) -> bool:
        """Synced once and the watch connected to etcd now."""
        w = self._watch
        return self._synced and w is not None and w.established.is_set()

    def wait_revision(self, revision: int, timeout: float) -> bool:
        """Block until the cache has folded ``revision`` (tests, read-your-writes)."""
        with self._changed:
            return self._changed.wait_for(
                lambda: self._synced and self._t.snap.revision >= revision, timeout
            )

    def _tables(self) -> _Tables:
        if not self._synced:
            raise ApiError(ErrorCode.ETCD_UNAVAILABLE, "state not loaded yet: etcd not read; retry")
        if not self.ready:
            raise ApiError(ErrorCode.ETCD_UNAVAILABLE, "etcd unreachable: the API's view is not current")
        return self._t

    # ---- reads (the ApiState protocol) ----

    def revision(self) -> int:
        return self._tables().snap.revision

    def leader(self) -> types_pb2.LeaderRecord | None:
        return self._tables().leader

    def cluster(self) -> Snapshot:
        """Racks, registrations, health and GPU overrides (shallow copies)."""
        t = self._tables()
        with self._lock:
            s = t.snap
            return Snapshot(
                revision=s.revision, racks=dict(s.racks), nodes=dict(s.nodes),
                health=dict(s.health), gpu_overrides=dict(s.gpu_overrides),
            )

    def node_cluster(self, node: str) -> tuple[Snapshot, str] | None:
        """One node's part of the cluster and its rack; None for an unknown node."""
        t = self._tables()
        with self._lock:
            s = t.snap
            rack_name = t.node_rack.get(node)
            reg = s.nodes.get(node)
            if rack_name is None and reg is None:
                return None
            rack_name = rack_name if rack_name is not None else reg.rack
            sub = node_subset(s, node, s.racks.get(rack_name), set(t.node_overrides.get(node, ())))
        return sub, rack_name

    def rack_cluster(self, rack: str) -> Snapshot | None:
        """One rack with its member nodes' records; None for an unknown rack."""
        t = self._tables()
        with self._lock:
            s = t.snap
            stored = s.racks.get(rack)
            if stored is None:
                return None
            out = Snapshot(revision=s.revision, racks={rack: stored})
            for n in stored.nodes:
                part = node_subset(s, n, None, set(t.node_overrides.get(n, ())))
                out.nodes.update(part.nodes)
                out.health.update(part.health)
                out.gpu_overrides.update(part.gpu_overrides)
        return out

    def job(self, name: str) -> types_pb2.JobSpec | None:
        return self._tables().snap.jobs.get(name)

    def jobs(self) -> dict[str, types_pb2.JobSpec]:
        t = self._tables()
        with self._lock:
            return dict(t.snap.jobs)

    def plan(self, job: str) -> types_pb2.Plan | None:
        return self._tables().snap.plans.get(job)

    def plan_history(self, job: str, limit: int = 1000) -> list[types_pb2.Plan]:
        """Read from etcd (O(result), rare): keeping every job's history of whole plans
        decoded in memory cost hundreds of MB at 10,000 nodes."""
        self._tables()
        return Store(self.etcd).plan_history(job)[-limit:]

    def acks(self, job: str) -> dict[int, types_pb2.Ack]:
        t = self._tables()
        with self._lock:
            return dict(t.acks.get(job, {}))

    def job_override(self, job: str) -> types_pb2.JobOverride | None:
        return self._tables().snap.job_overrides.get(job)

    def events(self, limit: int = 100) -> list[types_pb2.Event]:
        t = self._tables()
        with self._lock:
            return [t.events[s] for s in sorted(t.events)[-limit:]]
