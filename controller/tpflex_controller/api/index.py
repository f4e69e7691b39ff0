"""Cluster-wide GPU state totals and per-state node sets, kept up to date from the nodes
that changed, so that ``GET /v1/status`` costs O(changes since the last read) instead of a
walk over every node (56 ms of CPU at 10,000 nodes), and ``GET /v1/gpus?state=failed``
walks only the nodes that have a failed GPU.

The state source (``api/cache.py``) records which nodes changed since the index last
looked (``api.tables.Tables.dirty``); :class:`NodeIndex` folds their rendered rows (api/rows.py):
it is what a walk over every node's current row would sum, by construction (a row
replaces the node's previous contribution). A new table set (re-list after a compaction)
rebuilds it from every node. Pure: no I/O, the caller holds whatever lock it needs.
"""

from __future__ import annotations

from collections.abc import Iterable

from tpflex_controller.api.rows import STATES, NodeRow


class NodeIndex:
    """Sums over the current rows of every known node; ``apply`` replaces nodes' rows."""

    def __init__(self, epoch: object = None) -> None:
        self.epoch = epoch
        self._rows: dict[str, NodeRow] = {}
        self._counts = [0] * len(STATES)
        self._live = 0
        self._by_state: dict[str, set[str]] = {st: set() for st in STATES}
        self._sorted: dict[str, list[str]] = {}  # per state, valid until that set changes

    def apply(self, changed: Iterable[tuple[str, NodeRow | None]]) -> None:
        """Each ``(node, row)``: the node's current row, None when it is no longer known."""
        for node, row in changed:
            old = self._rows.pop(node, None)
            if old is not None:
                self._add(old, -1)
            if row is not None:
                self._rows[node] = row
                self._add(row, 1)

    def _add(self, row: NodeRow, sign: int) -> None:
        for i, c in enumerate(row.counts):
            self._counts[i] += sign * c
        self._live += sign * row.live
        for st in row.states:
            nodes = self._by_state[st]
            if sign > 0:
                nodes.add(row.name)
            else:
                nodes.discard(row.name)
            self._sorted.pop(st, None)

    def totals(self) -> tuple[int, int, tuple[int, ...]]:
        """(known nodes, live nodes, GPU counts per ``rows.STATES``)."""
        return len(self._rows), self._live, tuple(self._counts)

    def nodes_in_state(self, state: str) -> list[str]:
        """The nodes with at least one GPU in ``state``, sorted."""
        out = self._sorted.get(state)
        if out is None:
            out = self._sorted[state] = sorted(self._by_state.get(state, ()))
        return out
