"""The list endpoints' per-node rows, rendered once per change of the node and kept in a
bounded cache, so that ``GET /v1/gpus``, ``/v1/nodes``, ``/v1/racks`` and ``/v1/status``
cost O(their page) or O(nodes) dictionary lookups, not a re-derivation of every GPU of the
cluster per request (1.6 s at 10,000 nodes before).

A GPU's state depends only on its own node's records (registration, health, overrides,
flap holds) and its rack: :func:`render_node` derives one node's rows from that node's
part of the state (``ApiState.node_cluster``), exactly as ``views.gpu_views`` does for the
whole cluster. :class:`RowCache` keeps the rendered rows of at most ``max_nodes`` nodes
(least recently used out; ``rest.row_cache_nodes``) keyed by the node's version, which
the state source bumps whenever one of those records changes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tpflex_controller.api import schemas as s
from tpflex_controller.api import views
from tpflex_controller.store import Snapshot

STATES = ("healthy", "degraded", "failed", "drained")


@dataclass(frozen=True, slots=True)
class GpuRow:
    index: int
    state: str
    rack: str
    json: bytes  # the GpuView, rendered


@dataclass(frozen=True, slots=True)
class NodeRow:
    name: str
    rack: str
    live: bool
    gpus: tuple[GpuRow, ...]
    counts: tuple[int, int, int, int]  # per STATES
    json: bytes  # the NodeView, rendered
    states: frozenset[str]  # the states its GPUs are in (a filter skips the node at once)
    racks: frozenset[str]  # the racks its GPUs are in

    def state_counts(self) -> s.GpuStateCounts:
        return counts_view([self])


def counts_view(rows) -> s.GpuStateCounts:
    """The sum of the rows' GPU state counts."""
    total = [sum(c) for c in zip(*(r.counts for r in rows), strict=True)] or [0, 0, 0, 0]
    return s.GpuStateCounts(total=sum(total), **dict(zip(STATES, total, strict=True)))


def render_node(node: str, found: tuple[Snapshot, str] | None) -> NodeRow | None:
    """One node's rows from its part of the state (pure); None for an unknown node."""
    if found is None:
        return None
    snap, rack = found
    gpus = views.gpu_views(snap, node=node)
    counts = tuple(sum(g.state == st for g in gpus) for st in STATES)
    view = views.node_view(node, rack, snap, gpus)
    return NodeRow(
        name=node, rack=view.rack, live=view.live,
        gpus=tuple(GpuRow(g.index, g.state, g.rack, g.model_dump_json().encode()) for g in gpus),
        counts=counts, json=view.model_dump_json().encode(),
        states=frozenset(g.state for g in gpus), racks=frozenset(g.rack for g in gpus),
    )


class RowCache:
    """Rendered rows of at most ``max_nodes`` nodes, each valid for one node version."""

    def __init__(self, max_nodes: int = 20_000) -> None:
        if max_nodes < 1:
            raise ValueError("max_nodes must be >= 1")
        self.max_nodes = max_nodes
        self._lock = threading.Lock()
        self._rows: OrderedDict[str, tuple[object, NodeRow | None]] = OrderedDict()
        self.built = 0  # rows rendered so far

    def __len__(self) -> int:
        return len(self._rows)

    def get_many(self, wanted: list[tuple[str, object]], build: Callable[[str], NodeRow | None]
                 ) -> list[NodeRow | None]:
        """The rows of ``wanted`` (node, version) pairs, in order; one lock for the hits."""
        out: list[NodeRow | None] = []
        missing: list[int] = []
        with self._lock:
            rows = self._rows
            for node, version in wanted:
                kept = rows.get(node)
                if kept is not None and kept[0] == version:
                    rows.move_to_end(node)
                    out.append(kept[1])
                else:
                    missing.append(len(out))
                    out.append(None)
        for i in missing:
            node, version = wanted[i]
            out[i] = self.get(node, version, lambda node=node: build(node))
        return out

    def get(self, node: str, version: object, build: Callable[[], NodeRow | None]) -> NodeRow | None:
        with self._lock:
            kept = self._rows.get(node)
            if kept is not None and kept[0] == version:
                self._rows.move_to_end(node)
                return kept[1]
        row = build()  # outside the lock: readers of other nodes go on
        with self._lock:
            self.built += 1
            kept = self._rows.get(node)
            if kept is not None and kept[0] == version:
                return kept[1]  # rendered meanwhile by another reader: one row per version
            self._rows[node] = (version, row)
            self._rows.move_to_end(node)
            while len(self._rows) > self.max_nodes:
                self._rows.popitem(last=False)
        return row


def rack_members(snap: Snapshot) -> dict[str, tuple[str, ...]]:
    """Every rack -> the nodes whose rows its counts come from: the nodes it lists, then
    the registered nodes that no rack lists and that name it (a rack's GPU counts take
    those rows' GPUs that are in the rack)."""
    out = {name: tuple(rack.nodes) for name, rack in snap.racks.items()}
    listed = {n for rack in snap.racks.values() for n in rack.nodes}
    unlisted: dict[str, list[str]] = {}
    for reg in snap.nodes.values():
        if reg.name not in listed and reg.rack in out:
            unlisted.setdefault(reg.rack, []).append(reg.name)
    for name, extra in unlisted.items():
        out[name] += tuple(extra)
    return out


def render_rack(rack, rows: list[NodeRow | None]) -> bytes:
    """One rack's ``RackView`` JSON from its members' rows (pure)."""
    gpus = [g for r in rows if r is not None for g in r.gpus if g.rack == rack.name]
    return views.rack_view(rack, gpus).model_dump_json().encode()


def json_list(parts) -> bytes:
    return b"[" + b",".join(parts) + b"]"
