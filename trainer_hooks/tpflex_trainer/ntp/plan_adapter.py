"""From the controller's ``Plan`` (tpflex_proto ``Plan``/``JobSpec`` messages, or anything
with the same attribute names) to the runtime's placements. Pure: attribute access only.

A member is (replica, slot, stage): the stage is the plan stage's ``spec_stage`` (the
pipeline stage, one scale-up domain) and the slot of a GPU is its position in that spec
stage's ``ranks`` (the base-TP order of the domain). Every stage of a replica gets its own
placement at its own degree, with the replica's local batch. Dropped replicas (TP degree
0) are left out.
"""

from __future__ import annotations

from tpflex_trainer.ntp.errors import PlanError
from tpflex_trainer.ntp.layout import ReplicaPlacement


def _gpu_key(ref) -> tuple[str, int]:
    return (str(ref.node), int(ref.index))


def placements_from_plan(plan, spec) -> tuple[ReplicaPlacement, ...]:
    """``plan.replicas[i].stages[k].gpus`` (TP-rank order) mapped to slots of
    ``spec.replicas[index].stages[spec_stage].ranks``, one placement per stage."""
    out = []
    for rep in plan.replicas:
        if rep.tp_degree == 0 or not rep.stages:
            continue  # dropped: not part of the layout until repaired
        if rep.index >= len(spec.replicas):
            raise PlanError(f"plan replica {rep.index} is not in the job spec")
        spec_stages = spec.replicas[rep.index].stages
        if sorted(int(st.spec_stage) for st in rep.stages) != list(range(len(spec_stages))):
            raise PlanError(f"replica {rep.index} plans stages {[int(st.spec_stage) for st in rep.stages]}; "
                            f"its spec has {len(spec_stages)}, each to be planned once")
        for stage in rep.stages:
            k = int(stage.spec_stage)
            slot_of = {_gpu_key(g): i for i, g in enumerate(spec_stages[k].ranks)}
            try:
                slots = tuple(slot_of[_gpu_key(g)] for g in stage.gpus)
            except KeyError as exc:
                raise PlanError(f"replica {rep.index} stage {k} uses GPU {exc.args[0]} outside "
                                "its spec stage") from None
            out.append(ReplicaPlacement(int(rep.index), slots, int(rep.local_batch) or 1, k))
    return tuple(out)
