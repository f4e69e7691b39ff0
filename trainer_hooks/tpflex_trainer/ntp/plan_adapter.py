"""From the controller's ``Plan`` (tpflex_proto ``Plan``/``JobSpec`` messages, or anything
with the same attribute names) to the runtime's placements. Pure: attribute access only.

A member is (replica, slot): the slot of a GPU is its position in the job spec's stage
``ranks`` (the base-TP order of the domain). Dropped replicas (TP degree 0) are left out.
Only single-stage replicas (no pipeline parallelism) are supported by the runtime.
"""

from __future__ import annotations

from tpflex_trainer.ntp.errors import PlanError
from tpflex_trainer.ntp.layout import ReplicaPlacement


def _gpu_key(ref) -> tuple[str, int]:
    return (str(ref.node), int(ref.index))


def placements_from_plan(plan, spec) -> tuple[ReplicaPlacement, ...]:
    """``plan.replicas[i].stages[0].gpus`` (TP-rank order) mapped to slots of
    ``spec.replicas[index].stages[spec_stage].ranks``."""
    out = []
    for rep in plan.replicas:
        if rep.tp_degree == 0 or not rep.stages:
            continue  # dropped: not part of the layout until repaired
        if len(rep.stages) != 1:
            raise PlanError(f"replica {rep.index} has {len(rep.stages)} stages; the NTP runtime supports 1")
        stage = rep.stages[0]
        if rep.index >= len(spec.replicas):
            raise PlanError(f"plan replica {rep.index} is not in the job spec")
        spec_stages = spec.replicas[rep.index].stages
        if stage.spec_stage >= len(spec_stages):
            raise PlanError(f"replica {rep.index} refers to missing spec stage {stage.spec_stage}")
        slot_of = {_gpu_key(g): i for i, g in enumerate(spec_stages[stage.spec_stage].ranks)}
        try:
            slots = tuple(slot_of[_gpu_key(g)] for g in stage.gpus)
        except KeyError as exc:
            raise PlanError(f"replica {rep.index} uses GPU {exc.args[0]} outside its spec stage") from None
        out.append(ReplicaPlacement(int(rep.index), slots, int(rep.local_batch) or 1))
    return tuple(out)
