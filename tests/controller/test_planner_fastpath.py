"""The planner's fast paths equal straightforward per-GPU references on random inputs:
the per-rack clean check and set-based lost GPUs (``Survey.lost``), the watts a rack's
unboosted GPUs take (``power._fixed_w``), and whole plans with and without the racks'
node lists (without them every stage is checked per GPU)."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st
from tpflex_controller.planner import (
    ClusterState,
    GpuStatus,
    Policy,
    RackInfo,
    plan,
    power,
)
from tpflex_controller.planner.stages import StageDraft, Survey

from tests.controller.planner_fixtures import make_job, make_rack

STATUSES = [GpuStatus.HEALTHY, GpuStatus.DEGRADED, GpuStatus.FAILED, GpuStatus.DRAINED]


@st.composite
def clusters(draw):
    """Racks of 1-2x the TP degree (stages on the first GPUs or the whole rack), any GPU
    of a rack touched (also beyond its stage), dead nodes, slow GPUs and power pins."""
    tp = draw(st.integers(1, 5))
    stages = draw(st.integers(1, 2))
    size = tp * draw(st.sampled_from([1, 2]))
    headroom = draw(st.sampled_from([-0.1, 0.0, 0.1, 0.3]))
    racks = {f"r{i}": make_rack(f"r{i}", size, gpus_per_node=draw(st.sampled_from([1, 2])), headroom=headroom)
             for i in range(draw(st.integers(1, 4)) * stages)}
    gpus = [g for r in racks.values() for g in r.gpus]
    status = draw(st.lists(st.sampled_from(STATUSES), min_size=len(gpus), max_size=len(gpus)))
    gpu_status = {g: s for g, s in zip(gpus, status, strict=True) if s is not GpuStatus.HEALTHY}
    speed = {g: 0.8 for g in draw(st.sets(st.sampled_from(gpus), max_size=2))}
    pins = {g: draw(st.sampled_from([300.0, 650.0, 900.0])) for g in draw(st.sets(st.sampled_from(gpus), max_size=2))}
    nodes = sorted({g[0] for g in gpus})
    dead = draw(st.sets(st.sampled_from(nodes), max_size=2))
    live = frozenset(nodes) - dead if draw(st.booleans()) else None
    cluster = ClusterState(racks, gpu_status, speed, live, pins)
    job = make_job(racks, tp, stages, min_tp=draw(st.integers(1, tp)))
    return cluster, job


def _without_nodes(cluster: ClusterState) -> ClusterState:
    racks = {n: dataclasses.replace(r, nodes=()) for n, r in cluster.racks.items()}
    return dataclasses.replace(cluster, racks=racks)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(clusters())
def test_survey_lost_equals_a_per_gpu_look(world):
    cluster, job = world
    touched = set(cluster.gpu_status) | set(cluster.gpu_speed) | set(cluster.power_pins)
    for survey in (Survey(cluster), Survey(_without_nodes(cluster))):
        for rep in job.replicas:
            for stage in rep.stages:
                want = {g for g in stage.gpus if not cluster.usable(g)}
                clean = not touched & set(stage.gpus) and all(cluster.usable(g) for g in stage.gpus)
                got = survey.lost(stage.gpus, survey.cluster.racks[stage.rack])
                assert got is None if clean else got == want


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(clusters(), st.data())
def test_fixed_watts_equal_a_sum_over_the_rack(world, data):
    cluster, job = world
    stages = [st_ for rep in job.replicas for st_ in rep.stages]
    rack: RackInfo = cluster.racks[data.draw(st.sampled_from(stages)).rack]
    group = []
    for stage in (s for s in stages if s.rack == rack.name):
        usable = tuple(g for g in stage.gpus if cluster.usable(g))
        if usable:
            degree = data.draw(st.integers(1, len(usable)))
            group.append(StageDraft(0, rack, stage.gpus, usable, (), degree))
    if not group:
        return
    boosted = {g for s in group for g in s.used if g not in cluster.power_pins}
    want = sum(
        power.pinned_w(rack, cluster.power_pins[g]) if g in cluster.power_pins else rack.tdp_w
        for g in rack.gpus
        if g not in boosted and cluster.usable(g)
    )
    assert power._fixed_w(group, cluster) == want


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(clusters(), st.sampled_from(list(Policy)))
def test_plan_with_node_lists_equals_plan_checked_per_gpu(world, policy):
    cluster, job = world
    fast = plan(cluster, job, policy=policy)
    slow = plan(_without_nodes(cluster), job, policy=policy)
    assert fast == slow
