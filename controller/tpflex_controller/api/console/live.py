"""One console client's view: the first full snapshot, then the messages that bring it up
to date after each batch of changes from the feed (only the racks, jobs and events that
changed). Reads go through the ``ApiState`` interface only; no etcd round trip."""

from __future__ import annotations

from collections.abc import Iterable

from tpflex_controller import convert
from tpflex_controller.api.console import render
from tpflex_controller.api.feed import Change, Kind
from tpflex_controller.api.state import ApiState
from tpflex_controller.planner.model import GpuKey
from tpflex_controller.steps import StepStats

EVENTS_SHOWN = 100
_NODE_KINDS = frozenset({Kind.NODE, Kind.HEALTH, Kind.GPU_OVERRIDE})
_JOB_KINDS = frozenset({Kind.JOB, Kind.PLAN, Kind.ACK, Kind.JOB_OVERRIDE})


class ConsoleView:
    def __init__(self, reads: ApiState, steps: StepStats | None = None, scope: str = "") -> None:
        self.reads = reads
        self.steps = steps
        self.scope = scope  # "admin" or "read-only": the page shows actions to admins only
        self.node_rack: dict[str, str] = {}
        self.caps: dict[GpuKey, float] = {}
        self.last_event = 0
        self.jobs_sent: list[dict] | None = None

    # ---- full state ----

    def snapshot(self) -> dict:
        snap = self.reads.cluster()
        self.node_rack = {n: r.name for r in snap.racks.values() for n in r.nodes}
        self.caps = self._plan_caps()
        state = convert.cluster_state(snap, racks={})  # GPU states only: no rack infos needed
        unhealthy = render.unhealthy_by_node(state)
        racks = [render.render_rack(snap.racks[name], state, self.caps, unhealthy)
                 for name in sorted(snap.racks)]
        events = self.reads.events(EVENTS_SHOWN)
        self.last_event = events[-1].seq if events else 0
        self.jobs_sent = self._jobs()
        return {
            "scope": self.scope, "revision": snap.revision, "leader": self._leader(), "racks": racks,
            "jobs": self.jobs_sent, "events": [render.render_event(e) for e in events],
        }

    # ---- updates ----

    def apply(self, changes: Iterable[Change]) -> list[tuple[str, object]]:
        """The messages (name, data) that bring the client up to date after ``changes``."""
        changes = list(changes)
        kinds = {c.kind for c in changes}
        if Kind.RESYNC in kinds:
            return [("snapshot", self.snapshot())]
        racks, removed = self._racks_touched(changes)
        out: list[tuple[str, object]] = []
        if Kind.PLAN in kinds:
            racks |= self._caps_changed()
        if racks or removed:
            out.append(("racks", {"racks": self._render_racks(racks), "removed": sorted(removed)}))
        if kinds & _JOB_KINDS:
            jobs = self.refresh_jobs()
            if jobs is not None:
                out.append(("jobs", jobs))
        if Kind.EVENT in kinds:
            events = self._new_events()
            if events:
                out.append(("events", events))
        if Kind.LEADER in kinds:
            out.append(("leader", self._leader()))
        if out:
            out.append(("revision", max(c.revision for c in changes)))
        return out

    def refresh_jobs(self) -> list[dict] | None:
        """The jobs when they differ from the last sent (goodput moves without etcd)."""
        jobs = self._jobs()
        if jobs == self.jobs_sent:
            return None
        self.jobs_sent = jobs
        return jobs

    def _racks_touched(self, changes: list[Change]) -> tuple[set[str], set[str]]:
        racks: set[str] = set()
        removed: set[str] = set()
        rack_keys = {c.name for c in changes if c.kind is Kind.RACK}
        for name in rack_keys:  # membership first: a node's rack may have just changed
            if not self._reindex(name):
                removed.add(name)
        for c in changes:
            if c.kind is Kind.RACK and c.name not in removed:
                racks.add(c.name)
            elif c.kind in _NODE_KINDS and c.name in self.node_rack:
                racks.add(self.node_rack[c.name])
        racks -= removed
        return racks, removed

    def _reindex(self, rack: str) -> bool:
        """Re-read which nodes ``rack`` has; False when the rack no longer exists."""
        for node in [n for n, r in self.node_rack.items() if r == rack]:
            del self.node_rack[node]
        snap = self.reads.rack_cluster(rack)
        if snap is not None:
            self.node_rack.update({n: rack for n in snap.racks[rack].nodes})
        return snap is not None

    def _caps_changed(self) -> set[str]:
        new = self._plan_caps()
        moved = {g for g in new.keys() | self.caps.keys() if new.get(g) != self.caps.get(g)}
        self.caps = new
        return {self.node_rack[g[0]] for g in moved if g[0] in self.node_rack}

    def _render_racks(self, names: Iterable[str]) -> list[dict]:
        out = []
        for name in sorted(names):
            snap = self.reads.rack_cluster(name)
            if snap is not None:
                state = convert.cluster_state(snap, racks={})
                out.append(render.render_rack(snap.racks[name], state, self.caps))
        return out

    def _plan_caps(self) -> dict[GpuKey, float]:
        plans = (self.reads.plan(j) for j in self.reads.jobs())
        return render.plan_caps(p for p in plans if p is not None)

    def _jobs(self) -> list[dict]:
        reads = self.reads
        return [
            render.render_job(spec, reads.plan(name), reads.job_override(name), reads.acks(name),
                              self.steps.goodput(name) if self.steps is not None else None)
            for name, spec in sorted(reads.jobs().items())
        ]

    def _new_events(self) -> list[dict]:
        events = [e for e in self.reads.events(EVENTS_SHOWN) if e.seq > self.last_event]
        if events:
            self.last_event = events[-1].seq
        return [render.render_event(e) for e in events]

    def _leader(self) -> dict | None:
        record = self.reads.leader()
        return {"id": record.id, "address": record.address, "since": record.since} if record else None
