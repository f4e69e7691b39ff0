"""The REST API's read-only view of ``/tpflex/v1/``, fed by the process's shared informer.

REST reads are served from memory: no etcd round trip per request, and a one-object read
costs O(that object) (per-key dicts, a node -> rack index), a list read O(its result).
The informer's thread folds changes under a lock held only for the dict updates; readers take
the same lock for a lookup or a shallow dict copy (C speed) and never mutate what they get
(stored protobufs are shared, treat them as read-only).

Until the informer's first list, and while its watch is disconnected from etcd, reads
raise a 503 (``ETCD_UNAVAILABLE``) with a message; the informer resumes from the next
revision, so nothing is lost across an outage, and after a compaction it lists again and
hands over the differences (tpflex_proto.informer).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable

from google.protobuf.message import Message
from tpflex_proto import codec, keys, planstore, types_pb2
from tpflex_proto.etcd import Etcd, KeyValue
from tpflex_proto.informer import Batch, Informer
from tpflex_proto.informer import Change as KeyChange
from tpflex_proto.keys import Kind as KeyKind

from tpflex_controller.api.errors import ApiError, ErrorCode
from tpflex_controller.api.feed import Change, Handler, Kind, Subscribers, Unsubscribe, classify
from tpflex_controller.api.index import NodeIndex
from tpflex_controller.api.rows import NodeRow, RowCache, render_node
from tpflex_controller.store import (
    ASSEMBLER,
    Snapshot,
    Store,
    apply_kv,
    decode_or_skip,
    fold_plan_key,
)

log = logging.getLogger(__name__)

_NODE_KEYS = frozenset({KeyKind.NODE, KeyKind.HEALTH, KeyKind.GPU_OVERRIDE, KeyKind.GPU_HOLD})
_JOB_KEYS = frozenset({KeyKind.JOB_SPEC, KeyKind.JOB_PLAN, KeyKind.JOB_HISTORY, KeyKind.JOB_ASSIGN,
                       KeyKind.JOB_ACK, KeyKind.JOB_OVERRIDE})
_PLAN_KEYS = frozenset({KeyKind.JOB_PLAN, KeyKind.JOB_ASSIGN})
_epochs = itertools.count(1)


class _Tables:
    """Everything the API reads, keyed for O(1) lookups; mutated only by the feeder."""

    def __init__(self, revision: int = 0) -> None:
        self.epoch = next(_epochs)  # a fresh table set invalidates every rendered row
        self.node_ver: dict[str, int] = {}  # bumped when a record a node's rows derive from changes
        self.names_ver = 0  # bumped when the set of known nodes may have changed
        self._ver = 0  # bumped when any node's record (or a rack) changes
        self.dirty: set[str] = set()  # nodes touched since the NodeIndex last looked
        self.job_ver: dict[str, int] = {}  # bumped when a record of the job changes
        self.jobs_ver = 0  # bumped when any job's record changes
        self.snap = Snapshot(revision=revision)
        self.node_rack: dict[str, str] = {}  # rack members -> rack (registrations add theirs)
        self.node_overrides: dict[str, set[int]] = {}  # node -> GPU indices with an override or hold
        self.acks: dict[str, dict[int, types_pb2.Ack]] = {}
        self.events: dict[int, types_pb2.Event] = {}
        self.leader: types_pb2.LeaderRecord | None = None
        self.leader_present = False

    def fold_change(self, c: KeyChange, assembled: dict | None = None, i: int = 0) -> None:
        """One informer change record (decoded there; a malformed value was logged there
        and keeps what the tables had, except that a leader key still means a leader).
        ``assembled``: what :meth:`assemble_plans` made of the batch (``i``: the change's
        position in it); plan keys then only store the whole plan assembled there."""
        kind = c.parsed.kind if c.parsed is not None else None
        if kind is KeyKind.POWER:
            return  # the API shows no power plans: not even decoded
        if assembled is not None and kind in _PLAN_KEYS:
            self.jobs_ver += 1
            self.job_ver[c.parsed.name] = self.jobs_ver
            if kind is KeyKind.JOB_PLAN:
                if c.deleted:
                    self.snap.plans.pop(c.parsed.name, None)
                elif assembled.get(i) is not None:  # None: malformed, the old plan stays
                    self.snap.plans[c.parsed.name] = assembled[i]
            return
        if c.malformed and kind is not KeyKind.LEADER:
            return
        self.fold(c.key_value(), c.deleted, c.msg)

    def assemble_plans(self, changes) -> dict[int, types_pb2.Plan | None]:
        """The costly part of folding a batch with plan commits (decoding a job's whole
        plan, every GPU and cap), done before the readers' lock is taken: the feeder
        thread is the tables' only writer, and readers never look at plan parts. Indexes
        the batch's plan parts (in order) and assembles the whole plan of each new plan
        header; returns {position in ``changes``: the plan, None when malformed}, for
        :meth:`fold_change` to store under the lock."""
        out: dict[int, types_pb2.Plan | None] = {}
        snap = self.snap
        for i, c in enumerate(changes):
            k = c.parsed
            if k is None or k.kind not in _PLAN_KEYS:
                continue
            if k.kind is KeyKind.JOB_ASSIGN:
                pk = planstore.PlanKey("part", k.name, k.number, k.position)
                fold_plan_key(snap, pk, c.key_value(), c.deleted)
            elif c.deleted:
                snap.plan_parts.pop(k.name, None)
            else:
                try:
                    out[i] = planstore.whole(c.value, snap.plan_parts.get(k.name), ASSEMBLER, c.key)
                except codec.MalformedValue as exc:
                    log.warning("skipping malformed etcd value key=%s error=%s", c.key, exc)
                    out[i] = None
        return out

    def fold(self, kv: KeyValue, deleted: bool, msg: Message | None = None) -> None:
        k = keys.parse(kv.key)
        kind = k.kind if k is not None else None
        if kind in _JOB_KEYS:
            self.jobs_ver += 1
            self.job_ver[k.name] = self.jobs_ver
        elif kind in _NODE_KEYS:
            self._touch(k.name)
            if kind is KeyKind.NODE and deleted == (k.name in self.snap.nodes):
                self.names_ver += 1  # a node registers or goes
        if kind is KeyKind.LEADER:
            self._fold_leader(kv, deleted, msg)
        elif kind is KeyKind.EVENT:
            _fold_int(self.events, k.number, types_pb2.Event, kv, deleted, msg)
        elif kind is KeyKind.RACK:
            old = self.snap.racks.get(k.name)
            apply_kv(self.snap, kv, deleted, msg)
            self._index_rack(k.name, old)
        elif kind in (KeyKind.GPU_OVERRIDE, KeyKind.GPU_HOLD):
            apply_kv(self.snap, kv, deleted, msg)
            self._index_override(k.name, k.number)
        elif kind is KeyKind.JOB_ACK:
            _fold_int(self.acks.setdefault(k.name, {}), k.number, types_pb2.Ack, kv, deleted, msg)
        elif k is None and not deleted and (kv.key.startswith(keys.EVENTS) or "/acks/" in kv.key):
            log.warning("skipping malformed etcd key key=%s", kv.key)
        else:
            apply_kv(self.snap, kv, deleted, msg)

    def _fold_leader(self, kv: KeyValue, deleted: bool, msg: Message | None = None) -> None:
        self.leader_present = not deleted
        if deleted:
            self.leader = None
        else:
            self.leader = msg if msg is not None else decode_or_skip(types_pb2.LeaderRecord, kv)
        if self.leader_present and self.leader is None:  # unreadable, but a leader is elected
            self.leader = types_pb2.LeaderRecord(id="<unreadable>")

    def _index_rack(self, name: str, old: types_pb2.Rack | None) -> None:
        self.names_ver += 1
        for n in old.nodes if old is not None else ():
            self._touch(n)
            if self.node_rack.get(n) == name:
                del self.node_rack[n]
        new = self.snap.racks.get(name)
        for n in new.nodes if new is not None else ():
            self._touch(n)
            self.node_rack[n] = name
        for reg in self.snap.nodes.values():  # registered outside any rack's list, naming it
            if reg.rack == name and reg.name not in self.node_rack:
                self._touch(reg.name)

    def _touch(self, node: str) -> None:
        self._ver += 1
        self.node_ver[node] = self._ver
        self.dirty.add(node)

    def version(self, resource: str, name: str) -> tuple:
        """What a response about ``resource`` renders changes only when this does:
        ``job`` (a job's spec, plan, acks, override), ``node`` (a node's records or its
        rack), ``cluster`` (any node or rack), ``jobs`` (any job), ``all`` (anything)."""
        if resource == "job":
            return (self.epoch, self.job_ver.get(name, 0))
        if resource == "node":
            return (self.epoch, self.node_ver.get(name, 0))
        if resource == "cluster":
            return (self.epoch, self._ver, self.names_ver)
        if resource == "jobs":
            return (self.epoch, self.jobs_ver)
        return (self.epoch, self.snap.revision)

    def _index_override(self, node: str, index: int) -> None:
        if (node, index) in self.snap.gpu_overrides or (node, index) in self.snap.gpu_holds:
            self.node_overrides.setdefault(node, set()).add(index)
        else:
            self.node_overrides.get(node, set()).discard(index)


def _fold_int(table: dict, number: int, cls, kv: KeyValue, deleted: bool, msg=None) -> None:
    if deleted:
        table.pop(number, None)
        return
    if msg is None:
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
        hold = snap.gpu_holds.get((node, idx))
        if hold is not None:
            out.gpu_holds[(node, idx)] = hold
    return out


class ApiStateCache:
    """Read methods over the tables the process's informer feeds (``informer``; without
    one the cache runs its own on ``etcd``). ``start()`` registers with the informer (and
    starts an own one), ``stop()`` undoes it. Reads raise ApiError(503) until synced.
    ``subscribe(handler)``: the :class:`tpflex_controller.api.feed.ChangeFeed` of what it
    folds (live views such as the console's stream)."""

    def __init__(self, etcd: Etcd, *, retry_s: float = 0.5, informer: Informer | None = None,
                 row_cache_nodes: int = 20_000, on_warm: Callable[[], None] | None = None) -> None:
        self.etcd = etcd
        self.on_warm = on_warm  # called after each (re-)list's rows and index were built
        self.rows = RowCache(row_cache_nodes)  # rendered per-node rows (api/rows.py), bounded
        self._names: tuple[object, list[str]] = (None, [])
        self._own_informer = informer is None
        self.informer = informer if informer is not None else Informer(etcd, retry_s=retry_s)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._t = _Tables()
        self._synced = False
        self._unregister = None
        self._subscribers = Subscribers()
        self._index = NodeIndex()
        self._index_lock = threading.Lock()

    def subscribe(self, handler: Handler) -> Unsubscribe:
        return self._subscribers.subscribe(handler)

    # ---- lifecycle ----

    def start(self) -> ApiStateCache:
        self._unregister = self.informer.add_handler(self._on_batch)
        if self._own_informer:
            self.informer.start()
        return self

    def stop(self) -> None:
        if self._unregister is not None:
            self._unregister()
        if self._own_informer:
            self.informer.stop()

    def _on_batch(self, batch: Batch) -> None:
        """On the informer's thread: the whole state, a watch response, or the
        differences of a re-list after a compaction."""
        if batch.initial:
            tables = _Tables(batch.revision)
            for c in batch.changes:
                tables.fold_change(c)
            with self._changed:
                self._t, self._synced = tables, True
                self._changed.notify_all()
            log.info("api cache synced revision=%d", batch.revision)
            threading.Thread(target=self._warm_rows, args=(tables,), name="api-rows-warm", daemon=True).start()
            self._subscribers.publish([Change(Kind.RESYNC, "", batch.revision)])
            return
        t = self._t
        assembled = t.assemble_plans(batch.changes)  # outside the lock: readers go on
        with self._changed:
            for i, c in enumerate(batch.changes):
                t.fold_change(c, assembled, i)
            t.snap.revision = max(t.snap.revision, batch.revision)
            self._changed.notify_all()
        if not len(self._subscribers):
            return
        if batch.resync:
            self._subscribers.publish([Change(Kind.RESYNC, "", batch.revision)])
        else:
            self._subscribers.publish(
                [classify(c.key, c.mod_revision, c.deleted) for c in batch.changes]
            )

    # ---- state ----

    @property
    def ready(self) -> bool:
        """Synced once and the informer's watch connected to etcd now."""
        return self._synced and self.informer.connected

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
                gpu_holds=dict(s.gpu_holds),
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
                out.gpu_holds.update(part.gpu_holds)
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

    def _warm_rows(self, tables: _Tables) -> None:
        """Render every node's rows and the status index once after a (re-)list, off the
        request path, so that the first /v1/status or filtered /v1/gpus does not render
        the whole cluster (a first /v1/status built the index while the rows were being
        warmed: 7.9 s); then ``on_warm()``."""
        try:
            names = self.node_names()[: self.rows.max_nodes]
            for i in range(0, len(names), 256):
                if self._t is not tables:
                    return  # a newer list: its own warm-up runs
                self.node_rows(names[i:i + 256])
            self.status_counts()
        except ApiError:
            return  # etcd went away meanwhile; rows are rendered on demand
        if self.on_warm is not None and self._t is tables:
            self.on_warm()

    def node_names(self) -> list[str]:
        """Every node known (rack members and registered nodes), sorted; kept until the
        set may have changed."""
        t = self._tables()
        with self._lock:
            version = (t.epoch, t.names_ver)
            if self._names[0] == version:
                return self._names[1]
            names = set(t.node_rack)
            names.update(t.snap.nodes)
        out = sorted(names)
        self._names = (version, out)
        return out

    def version(self, resource: str, name: str = "") -> tuple:
        """The version of what a response renders (``_Tables.version``): equal versions,
        equal responses. Raises ApiError(503) as the reads do."""
        t = self._tables()
        with self._lock:
            return t.version(resource, name)

    def _indexed(self, read):
        """``read(index)`` on the NodeIndex with every node changed since its last use
        folded in (one reader at a time: the fold is O(changes))."""
        t = self._tables()
        with self._index_lock:
            with self._lock:
                fresh = self._index.epoch != t.epoch
                dirty, t.dirty = t.dirty, set()
            if fresh:
                self._index = NodeIndex(t.epoch)
                nodes = self.node_names()
            else:
                nodes = sorted(dirty)
            for i in range(0, len(nodes), 256):
                chunk = nodes[i:i + 256]
                self._index.apply(zip(chunk, self.node_rows(chunk), strict=True))
            return read(self._index)

    def status_counts(self) -> tuple[int, int, tuple[int, ...]]:
        """(known nodes, live nodes, GPU counts per ``rows.STATES``): O(changes)."""
        return self._indexed(NodeIndex.totals)

    def nodes_in_state(self, state: str) -> list[str]:
        """The nodes with a GPU in ``state``, sorted."""
        return self._indexed(lambda index: index.nodes_in_state(state))

    def rack_count(self) -> int:
        return len(self._tables().snap.racks)

    def node_row(self, node: str) -> NodeRow | None:
        """One node's rendered rows (api/rows.py), re-rendered only after it changed."""
        return self.node_rows([node])[0]

    def node_rows(self, nodes: list[str]) -> list[NodeRow | None]:
        """The rendered rows of ``nodes``, in order (one lock round for all)."""
        t = self._tables()
        with self._lock:
            ver = t.node_ver
            wanted = [(n, (t.epoch, ver.get(n, 0))) for n in nodes]
        return self.rows.get_many(wanted, lambda n: render_node(n, self.node_cluster(n)))
