"""The hooks refuse plans that do not fit the job (pure checks: check_plan,
placements_from_plan, plan_placements), naming why."""

from __future__ import annotations

import pytest
from tpflex_proto import types_pb2
from tpflex_trainer.demo.launcher import demo_job_spec
from tpflex_trainer.demo.model import DEMO_MODEL
from tpflex_trainer.hooks.control import PlanRejected, check_plan
from tpflex_trainer.hooks.trainer import plan_placements
from tpflex_trainer.ntp.errors import LayoutError, PlanError
from tpflex_trainer.ntp.layout import ReplicaPlacement
from tpflex_trainer.ntp.plan_adapter import placements_from_plan

UNITS = DEMO_MODEL.unit_counts()
SPEC = demo_job_spec("job-a", [("rack-0", "node-0", 4), ("rack-1", "node-1", 4)], 4, UNITS)


def plan(generation: int = 2, job: str = "job-a", gpus=None, local=(4, 3)) -> types_pb2.Plan:
    """Replica 0 at TP 4; replica 1 on ``gpus`` (default: node-1 without GPU 2)."""
    gpus = [("node-1", i) for i in (0, 1, 3)] if gpus is None else gpus
    p = types_pb2.Plan(job=job, generation=generation, policy="ntp-pw")
    for index, used in enumerate([[("node-0", i) for i in range(4)], gpus]):
        rep = p.replicas.add(index=index, tp_degree=len(used), local_batch=local[index])
        if used:
            rep.stages.add(rack=f"rack-{index}", tp_degree=len(used), spec_stage=0,
                           gpus=[types_pb2.GpuRef(node=n, index=i) for n, i in used])
    return p


def test_a_newer_plan_of_this_job_maps_gpus_to_spec_slots():
    assert plan_placements(plan(), SPEC, "job-a", 1, UNITS) == (
        ReplicaPlacement(0, (0, 1, 2, 3), 4), ReplicaPlacement(1, (0, 1, 3), 3))
    # TP-rank order is the plan's, slots are the spec's
    reordered = plan(gpus=[("node-1", 3), ("node-1", 0)], local=(4, 2))
    assert placements_from_plan(reordered, SPEC)[1] == ReplicaPlacement(1, (3, 0), 2)


def test_a_dropped_replica_is_left_out():
    assert plan_placements(plan(gpus=[]), SPEC, "job-a", 1, UNITS) == (
        ReplicaPlacement(0, (0, 1, 2, 3), 4),)


@pytest.mark.parametrize("generation,applied", [(1, 1), (1, 2), (0, 0)])
def test_a_plan_not_newer_than_the_applied_one_is_refused(generation, applied):
    with pytest.raises(PlanRejected, match=f"generation {generation} is not newer than applied {applied}"):
        check_plan(plan(generation), "job-a", applied)


def test_a_plan_of_another_job_is_refused():
    with pytest.raises(PlanRejected, match="plan is for job 'job-b', this is job 'job-a'"):
        plan_placements(plan(job="job-b"), SPEC, "job-a", 0, UNITS)


def test_a_gpu_outside_the_replicas_spec_stage_is_refused():
    foreign = plan(gpus=[("node-1", 0), ("node-0", 1)])  # a GPU of the other rack
    with pytest.raises(PlanError, match=r"replica 1 stage 0 uses GPU \('node-0', 1\) outside its spec stage"):
        plan_placements(foreign, SPEC, "job-a", 1, UNITS)
    unknown = plan(gpus=[("node-7", 0)])
    with pytest.raises(PlanError, match="node-7"):
        placements_from_plan(unknown, SPEC)


def test_a_replica_or_stage_missing_from_the_spec_is_refused():
    extra = plan()
    extra.replicas.add(index=2, tp_degree=1, local_batch=1).stages.add(
        spec_stage=0, gpus=[types_pb2.GpuRef(node="node-1", index=0)])
    with pytest.raises(PlanError, match="plan replica 2 is not in the job spec"):
        plan_placements(extra, SPEC, "job-a", 1, UNITS)
    bad_stage = plan()
    bad_stage.replicas[1].stages[0].spec_stage = 3
    with pytest.raises(PlanError, match=r"replica 1 plans stages \[3\]; its spec has 1"):
        plan_placements(bad_stage, SPEC, "job-a", 1, UNITS)


def test_a_layout_the_runtime_cannot_build_is_refused():
    twice = plan(gpus=[("node-1", 0), ("node-1", 0)], local=(4, 2))
    with pytest.raises(LayoutError):
        plan_placements(twice, SPEC, "job-a", 1, UNITS)
    no_replicas = plan(gpus=[])
    no_replicas.replicas[0].tp_degree = 0
    with pytest.raises(LayoutError, match="at least one replica"):
        plan_placements(no_replicas, SPEC, "job-a", 1, UNITS)


def test_a_pipeline_plan_places_every_stage_at_its_own_degree():
    """2 replicas x 2 stages x TP 2 (one rack per stage): each plan stage becomes a
    placement of its spec stage; every stage of a replica has the replica's batch."""
    from tpflex_trainer.ntp.stages import split_stages

    racks = [("rack-0", "node-0", 2), ("rack-1", "node-1", 2), ("rack-2", "node-2", 2), ("rack-3", "node-3", 2)]
    spec = demo_job_spec("job-p", racks, 4, UNITS, stages=2)
    assert [[st.rack for st in rep.stages] for rep in spec.replicas] == [["rack-0", "rack-1"], ["rack-2", "rack-3"]]
    p = types_pb2.Plan(job="job-p", generation=2, policy="ntp")
    used = {(0, 0): [0, 1], (0, 1): [0, 1], (1, 0): [1], (1, 1): [0, 1]}  # stage 0 of replica 1 lost GPU 0
    for r in range(2):
        rep = p.replicas.add(index=r, tp_degree=min(len(used[r, k]) for k in range(2)), local_batch=4 - 2 * r)
        for k in (1, 0):  # any order
            node = f"node-{2 * r + k}"
            rep.stages.add(rack=f"rack-{2 * r + k}", tp_degree=len(used[r, k]), spec_stage=k,
                           gpus=[types_pb2.GpuRef(node=node, index=i) for i in used[r, k]])
    placed = plan_placements(p, spec, "job-p", 1, [UNITS, UNITS])
    assert sorted(placed, key=lambda x: (x.replica, x.stage)) == [
        ReplicaPlacement(0, (0, 1), 4, 0), ReplicaPlacement(0, (0, 1), 4, 1),
        ReplicaPlacement(1, (1,), 2, 0), ReplicaPlacement(1, (0, 1), 2, 1)]
    assert [len(s) for s in split_stages(placed, 2)] == [2, 2]
    missing = types_pb2.Plan()
    missing.CopyFrom(p)
    del missing.replicas[1].stages[0]
    with pytest.raises(PlanError, match=r"replica 1 plans stages \[0\]; its spec has 2"):
        plan_placements(missing, spec, "job-p", 1, [UNITS, UNITS])
