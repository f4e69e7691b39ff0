"""What the trainer hooks know of plans and job specs, without a process group: the
spec's ranks and stages, a plan's placements for this job (or why it is refused), the
rendezvous name of a round, and the record of an applied plan. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from tpflex_proto import types_pb2

from tpflex_trainer.hooks.control import check_plan
from tpflex_trainer.ntp.layout import Member, ReplicaPlacement, validate_request
from tpflex_trainer.ntp.plan_adapter import placements_from_plan
from tpflex_trainer.ntp.stages import split_stages


class HooksError(RuntimeError):
    """The job cannot go on here (no plan within the wait, this rank not in the spec)."""


@dataclass(frozen=True)
class AppliedPlan:
    """One generation as this rank applied it (for logs, tests and the demo's summary)."""

    generation: int
    tp_degree: int  # of this rank's replica; 0 when idle
    world_size: int
    source: str  # live / checkpoint / init / idle
    step: int  # training resumes from this step
    reshard_s: float
    bytes_moved: int
    peer_units: int
    after_failure: bool
    applied_at: float
    bytes_sent: int = 0  # by this rank in the reshard (0: it was not a source)
    epoch: int = 0  # the plan's restart epoch (the round is (generation, epoch))
    # members (replica, slot, stage) a torn step left behind, sent their units again
    behind: tuple[tuple[int, int, int], ...] = ()


def spec_stages(spec: types_pb2.JobSpec) -> int:
    """Pipeline stages per replica (every replica of the spec has the same count)."""
    counts = {len(rep.stages) for rep in spec.replicas}
    if len(counts) != 1 or 0 in counts:
        raise HooksError(f"job spec replicas have {sorted(counts)} stages: every replica needs the same "
                         "number of stages (at least one)")
    return counts.pop()


def spec_ranks(spec: types_pb2.JobSpec) -> list[tuple[Member, tuple[str, int]]]:
    spec_stages(spec)
    out = []
    for r, rep in enumerate(spec.replicas):
        for k, stage in enumerate(rep.stages):
            for slot, g in enumerate(stage.ranks):
                out.append((Member(r, slot, k), (g.node, g.index)))
    return out


def plan_placements(plan: types_pb2.Plan, spec: types_pb2.JobSpec, job: str,
                    applied_generation: int,
                    unit_counts: dict[str, int] | list[dict[str, int]]) -> tuple[ReplicaPlacement, ...]:
    """The placements of a plan this job can apply; PlanRejected (another job, not newer
    than the applied generation) or an NtpError (a GPU outside the job spec, a stage
    missing, an invalid layout of a stage) naming why not. ``unit_counts``: per stage
    (or one dict without stages). Pure."""
    check_plan(plan, job, applied_generation)
    placements = placements_from_plan(plan, spec)
    per_stage = [unit_counts] if isinstance(unit_counts, dict) else list(unit_counts)
    for counts, placed in zip(per_stage, split_stages(placements, len(per_stage)), strict=True):
        validate_request(counts, placed, spec.base_tp)
    return placements


def endpoint_ports(endpoints) -> list[int]:
    """The ports of ``host:port`` endpoints (connections to them are never shut down)."""
    out = []
    for e in endpoints:
        port = str(e).rpartition(":")[2]
        if port.isdigit():
            out.append(int(port))
    return out


def round_name(plan: types_pb2.Plan) -> str:
    """The rendezvous namespace of a plan in a restart epoch (``g<generation>[e<epoch>]``)."""
    return f"{plan.generation}e{plan.restart.epoch}" if plan.restart.epoch else str(plan.generation)
