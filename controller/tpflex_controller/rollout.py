"""Tracking one plan generation's rollout through its phases (pure, no I/O).

detected -> committed -> power_applied (every changed node's agent holds the caps) ->
acked (every rank the plan uses acked the generation). The tracker says when a phase is
reached; the loop writes the updated event and observes the metric.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tpflex_proto import types_pb2


class Phase(enum.StrEnum):
    DETECTED = "detected"
    COMMITTED = "committed"
    POWER_APPLIED = "power_applied"
    ACKED = "acked"


@dataclass
class Rollout:
    job: str
    generation: int
    event: types_pb2.Event  # the decision's event record (phases appended as reached)
    pending_nodes: dict[str, int]  # node -> NodePowerPlan generation not yet applied
    ranks: int  # ranks the plan uses (each must ack)
    reached: dict[Phase, float] = field(default_factory=dict)
    acked: set[int] | None = None  # ranks that acked this generation (None: not counted yet)

    def done(self) -> bool:
        return Phase.ACKED in self.reached and Phase.POWER_APPLIED in self.reached


class RolloutTracker:
    """The latest rollout of each job; a newer generation replaces an unfinished one."""

    def __init__(self) -> None:
        self._by_job: dict[str, Rollout] = {}

    def get(self, job: str) -> Rollout | None:
        return self._by_job.get(job)

    def start(self, rollout: Rollout, detected_at: float, committed_at: float) -> list[Phase]:
        rollout.reached[Phase.DETECTED] = detected_at
        rollout.reached[Phase.COMMITTED] = committed_at
        self._by_job[rollout.job] = rollout
        reached = [Phase.DETECTED, Phase.COMMITTED]
        if not rollout.pending_nodes:
            rollout.reached[Phase.POWER_APPLIED] = committed_at
            reached.append(Phase.POWER_APPLIED)
        return reached

    def power_applied(self, node: str, node_generation: int, at: float) -> list[Rollout]:
        """A node's agent holds ``node_generation``: the rollouts that just completed power."""
        out = []
        for r in self._by_job.values():
            want = r.pending_nodes.get(node)
            if want is None or node_generation < want:
                continue
            del r.pending_nodes[node]
            if not r.pending_nodes and Phase.POWER_APPLIED not in r.reached:
                r.reached[Phase.POWER_APPLIED] = at
                out.append(r)
        return out

    def acks_seen(self, job: str, acks: dict[int, int], ranks: set[int], at: float) -> Rollout | None:
        """``ranks`` of ``job`` acked (their latest acked generation in ``acks``): the rollout
        if it just became fully acked. O(len(ranks)); the first call of a rollout counts
        every ack already known."""
        r = self._by_job.get(job)
        if r is None or Phase.ACKED in r.reached or r.ranks == 0:
            return None
        seen = ranks if r.acked is not None else acks.keys()
        if r.acked is None:
            r.acked = set()
        r.acked.update(rank for rank in seen if acks.get(rank, 0) >= r.generation)
        if len(r.acked) >= r.ranks:
            r.reached[Phase.ACKED] = at
            return r
        return None

    def forget(self, job: str) -> None:
        self._by_job.pop(job, None)

    def clear(self) -> None:
        self._by_job.clear()


def event_phases(r: Rollout) -> list[types_pb2.PhaseTiming]:
    return [types_pb2.PhaseTiming(phase=p.value, at=t) for p, t in r.reached.items()]

