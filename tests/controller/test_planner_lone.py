"""The planner's one-pass common case (``planner/lone.py``) equals the general path on
random clusters: whole plans compared field by field and as the bytes readers get, with
racks shared by two replicas, pinned and multi-stage replicas, dead nodes, drained and
degraded GPUs, GPUs listed beyond a node's count and racks whose GPU order is not the
node order (the cases the one pass hands to the general path)."""

from __future__ import annotations

import dataclasses
import random

from hypothesis import given, settings
from hypothesis import strategies as st
from tpflex_controller import convert
from tpflex_controller.planbytes import PlanEncoder
from tpflex_controller.planner import (
    ClusterState,
    GpuStatus,
    JobOverrides,
    JobSpec,
    Policy,
    plan,
)
from tpflex_controller.planner import planner as general
from tpflex_controller.planner.lone import plan_lone
from tpflex_controller.planner.model import ReplicaSpec, StageSpec
from tpflex_controller.planner.power import Curve
from tpflex_controller.planner.stages import Survey
from tpflex_proto import codec
from tpflex_proto.powermodel import DEFAULT_POWER_MODEL

from tests.controller.planner_fixtures import make_rack

STATUSES = [GpuStatus.DEGRADED, GpuStatus.FAILED, GpuStatus.FAILED, GpuStatus.DRAINED]


def _reference(cluster: ClusterState, job: JobSpec, overrides: JobOverrides | None = None):
    """``plan`` with every replica through the general path."""
    ctx = general.context(cluster, job, None, None, overrides)
    outcomes = general.plan_replicas(ctx, cluster, job, range(len(job.replicas)), lone=False)
    return general.assemble(ctx, job, outcomes)


def indexed(cluster: ClusterState) -> ClusterState:
    """``cluster`` with the indexes the controller's view keeps (ClusterState.node_racks,
    down_nodes), derived here from the racks and the live nodes."""
    node_racks = {n: name for name, r in cluster.racks.items() for n in r.nodes}
    live = cluster.live_nodes
    down = set() if live is None else {n for n in node_racks if n not in live}
    return dataclasses.replace(cluster, node_racks=node_racks, down_nodes=down)


def _assert_same_plan(cluster, job, overrides=None) -> None:
    """The one pass (with and without the view's indexes) gives the general path's plan."""
    want = _reference(cluster, job, overrides)
    for state in (cluster, indexed(cluster)):
        got = plan(state, job, overrides=overrides)
        assert got == want
        assert got.power_caps == want.power_caps and dict(got.power_caps) == dict(want.power_caps)
        assert PlanEncoder().encode(got, 5, cause="c") == PlanEncoder().encode(want, 5, cause="c")
        assert PlanEncoder().split(got, 5)[1] == PlanEncoder().split(want, 5)[1]


@st.composite
def worlds(draw):
    tp = draw(st.integers(2, 8))
    per_node = draw(st.sampled_from([n for n in (1, 2, 4) if tp % n == 0]))
    headroom = draw(st.sampled_from([-0.1, 0.0, 0.05, 0.3]))
    count = draw(st.integers(1, 6))
    racks = {f"r{i}": make_rack(f"r{i}", tp, gpus_per_node=per_node, headroom=headroom) for i in range(count)}
    rarely = st.sampled_from([False, False, False, True])
    if draw(rarely):  # a rack whose GPUs are not in node order
        name = draw(st.sampled_from(sorted(racks)))
        gpus = list(racks[name].gpus)
        draw(st.randoms(use_true_random=False)).shuffle(gpus)
        racks[name] = dataclasses.replace(racks[name], gpus=tuple(gpus))
    gpus = [g for r in racks.values() for g in r.gpus]
    status = {g: draw(st.sampled_from(STATUSES)) for g in draw(st.sets(st.sampled_from(gpus), min_size=1, max_size=6))}
    if draw(rarely):  # a GPU listed beyond its node's count
        status[(gpus[0][0], per_node + 1)] = GpuStatus.FAILED
    nodes = sorted({g[0] for g in gpus})
    dead = draw(st.sets(st.sampled_from(nodes), max_size=1)) if draw(rarely) else set()
    live = frozenset(nodes) - dead if draw(st.booleans()) else None
    names = sorted(racks)
    replicas = []
    for k in range(count + draw(rarely)):  # a rack each, at times one more replica
        stage_racks = [names[k % count]]
        if draw(rarely):  # another stage, or another rack (maybe one taken)
            stage_racks = draw(st.lists(st.sampled_from(names), min_size=1, max_size=2))
        replicas.append(ReplicaSpec(tuple(StageSpec(r, racks[r].gpus[:tp]) for r in stage_racks)))
    units = {"heads": draw(st.sampled_from([64, 64, tp, max(1, tp - 1)])), "ffn": 128}
    job = JobSpec("job", tp, tuple(replicas), units, min_tp=draw(st.sampled_from([1, 1, 1, tp // 2, tp])), local_batch=draw(st.sampled_from([1, 8, 33])))
    pinned = draw(st.sets(st.integers(0, len(replicas) - 1), max_size=1)) if draw(rarely) else set()
    pins = {i: draw(st.integers(1, tp)) for i in pinned}
    return ClusterState(racks, status, live_nodes=live), job, JobOverrides(pins=pins)


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(worlds())
def test_one_pass_equals_the_general_path(world):
    cluster, job, overrides = world
    _assert_same_plan(cluster, job, overrides)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(worlds(), st.sampled_from([Policy.NTP, Policy.DP_DROP, Policy.SPARE]))
def test_other_policies_are_unchanged(world, policy):
    cluster, job, overrides = world
    job = dataclasses.replace(job, policy=policy, spare_racks=())
    _assert_same_plan(cluster, job, overrides)


def _big_world(racks: int, tp: int, failed_fraction: float, seed: int):
    rng = random.Random(seed)
    infos = {f"r{i:03d}": make_rack(f"r{i:03d}", tp, gpus_per_node=4, headroom=0.05) for i in range(racks)}
    gpus = [g for r in infos.values() for g in r.gpus]
    status = {g: rng.choice([GpuStatus.FAILED, GpuStatus.DRAINED]) for g in rng.sample(gpus, int(len(gpus) * failed_fraction))}
    reps = tuple(ReplicaSpec((StageSpec(n, r.gpus),)) for n, r in infos.items())
    job = JobSpec("job", tp, reps, {"heads": 144, "ffn": 576}, local_batch=8)
    live = frozenset(g[0] for g in gpus)
    return ClusterState(infos, status, live_nodes=live), job


def test_the_common_case_is_planned_in_one_pass_and_equals_the_general_path():
    """72-GPU racks with 2% of GPUs failed or drained (several per rack at times): every
    degraded replica is planned by the one pass, and the plan is the general path's."""
    cluster, job = _big_world(120, 72, 0.02, seed=3)
    done, rest = plan_lone(Survey(cluster), job, range(len(job.replicas)), {}, 72, Curve(DEFAULT_POWER_MODEL),
                           general.ReplicaOutcome)
    assert rest == []
    lost_racks = {r for r, info in cluster.racks.items() if any(g in cluster.gpu_status for g in info.gpus)}
    assert {job.replicas[i].stages[0].rack for i in done} == lost_racks
    assert any(len(o.assignment.stages[0].gpus) < 71 for o in done.values())  # some lost 2+
    _assert_same_plan(cluster, job)
    got = plan(cluster, job)  # and the bytes as protobuf encodes the whole plan
    assert PlanEncoder().encode(got, 5, cause="c") == codec.encode(convert.plan_to_proto(got, 5, cause="c"))


def test_a_rack_claimed_twice_goes_to_the_general_path():
    cluster, job = _big_world(4, 8, 0.0, seed=1)
    r0 = cluster.racks["r000"]
    cluster = dataclasses.replace(cluster, gpu_status={r0.gpus[3]: GpuStatus.FAILED})
    job = dataclasses.replace(job, replicas=(*job.replicas, job.replicas[0]))
    done, rest = plan_lone(Survey(cluster), job, range(len(job.replicas)), {}, 8, Curve(DEFAULT_POWER_MODEL),
                           general.ReplicaOutcome)
    assert done == {} and rest == [0, 4]
    _assert_same_plan(cluster, job)
