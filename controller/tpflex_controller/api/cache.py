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

import logging
import threading
from collections.abc import Callable

from tpflex_proto import types_pb2
from tpflex_proto.etcd import Etcd
from tpflex_proto.informer import Batch, Informer

from tpflex_controller.api.errors import ApiError, ErrorCode
from tpflex_controller.api.feed import (
    Change,
    Handler,
    Kind,
    Subscribers,
    Unsubscribe,
    classify,
)
from tpflex_controller.api.index import NodeIndex
from tpflex_controller.api.rows import (
    NodeRow,
    RowCache,
    rack_members,
    render_node,
    render_rack,
)
from tpflex_controller.api.tables import Tables, node_subset
from tpflex_controller.store import Snapshot, Store

log = logging.getLogger(__name__)


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
        # (version, sorted rack names, rack -> member nodes): kept until a rack or a
        # node's placement may have changed; rendered racks: rack -> (rack, members,
        # members' versions, JSON)
        self._placement: tuple[object, list[str], dict[str, tuple[str, ...]]] = (None, [], {})
        self._rack_json: dict[str, tuple[object, tuple, tuple, bytes]] = {}
        self._rack_lock = threading.Lock()
        self.racks_rendered = 0  # rack views rendered so far
        self._own_informer = informer is None
        self.informer = informer if informer is not None else Informer(etcd, retry_s=retry_s)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._t = Tables()
        self._synced = False
        self._warm_epoch = None
        self._unregister = None
        self._subscribers = Subscribers()
        self._index = NodeIndex()
        self._index_lock = threading.Lock()

    def subscribe(self, handler: Handler) -> Unsubscribe:
        return self._subscribers.subscribe(handler)

    # ---- lifecycle ----

    def start(self, wrap: Callable[[Callable[[Batch], None]], Callable[[Batch], None]] | None = None
              ) -> ApiStateCache:
        """Register with the informer; ``wrap``: a wrapper of the batch handler (e.g. the
        stall log's timing, api/stalls.py), applied once here."""
        handler = self._on_batch if wrap is None else wrap(self._on_batch)
        self._unregister = self.informer.add_handler(handler)
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
            tables = Tables(batch.revision)
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

    def _tables(self) -> Tables:
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

    def events(self, limit: int = 100, job: str | None = None) -> list[types_pb2.Event]:
        """The latest ``limit`` events (of ``job`` only, when given: searched back through
        the whole stored log, not only its latest entries), oldest first."""
        t = self._tables()
        with self._lock:
            seqs = sorted(t.events)
            if job is None:
                return [t.events[s] for s in seqs[-limit:]]
            out: list[types_pb2.Event] = []
            for s in reversed(seqs):
                if len(out) == limit:
                    break
                if t.events[s].job == job:
                    out.append(t.events[s])
            return out[::-1]

    def _warm_rows(self, tables: Tables) -> None:
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
        if self._t is tables:
            self._warm_epoch = tables.epoch
            if self.on_warm is not None:
                self.on_warm()

    @property
    def warm(self) -> bool:
        """The current tables' rows and status index were rendered once (``_warm_rows``)."""
        return self._synced and self._warm_epoch == self._t.epoch

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

    def _racks(self) -> tuple[list[str], dict[str, tuple[str, ...]]]:
        t = self._tables()
        with self._lock:
            version = (t.epoch, t.names_ver)
            if self._placement[0] == version:
                return self._placement[1], self._placement[2]
            s = t.snap
            snap = Snapshot(racks=dict(s.racks), nodes=dict(s.nodes))
        members = rack_members(snap)
        names = sorted(members)
        with self._rack_lock:
            self._placement = (version, names, members)
            for gone in self._rack_json.keys() - members.keys():
                del self._rack_json[gone]
        return names, members

    def racks_of(self, nodes) -> set[str]:
        """The racks whose views show ``nodes`` (the rack listing each, or the one it
        names when none lists it); unknown nodes have none."""
        t = self._tables()
        with self._lock:
            out = set()
            for n in nodes:
                rack = t.node_rack.get(n)
                if rack is None:
                    reg = t.snap.nodes.get(n)
                    rack = reg.rack if reg is not None else None
                if rack is not None:
                    out.add(rack)
            return out

    def rack_names(self) -> list[str]:
        """Every rack, sorted (kept until the racks or a node's placement may change)."""
        return self._racks()[0]

    def rack_rows(self, racks: list[str]) -> list[bytes]:
        """The ``RackView`` JSON of each of ``racks`` that exists, in order: O(the racks'
        nodes) look-ups, re-rendered only when the rack or one of its nodes changed."""
        members = self._racks()[1]
        t = self._tables()
        with self._lock:
            wanted = [(r, t.snap.racks.get(r), members.get(r, ())) for r in racks]
            wanted = [(r, rack, m, tuple(t.node_ver.get(n, 0) for n in m))
                      for r, rack, m in wanted if rack is not None]
        out = []
        for name, rack, nodes, vers in wanted:
            with self._rack_lock:
                kept = self._rack_json.get(name)
            if kept is not None and kept[0] is rack and kept[1] == nodes and kept[2] == vers:
                out.append(kept[3])
                continue
            body = render_rack(rack, self.node_rows(list(nodes)))
            with self._rack_lock:
                self.racks_rendered += 1
                if name in self._placement[2]:  # not a rack gone meanwhile
                    self._rack_json[name] = (rack, nodes, vers, body)
            out.append(body)
        return out

    def version(self, resource: str, name: str = "") -> tuple:
        """The version of what a response renders (``Tables.version``): equal versions,
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
