"""Property tests of the planner (hypothesis), plus an exhaustive sweep of small racks."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tpflex_controller.planner import (
    ClusterState,
    GpuStatus,
    JobSpec,
    PlanResult,
    Policy,
    ReplicaState,
    plan,
)

from tests.controller.planner_fixtures import make_job, make_racks

STATUSES = [GpuStatus.HEALTHY, GpuStatus.DEGRADED, GpuStatus.FAILED, GpuStatus.DRAINED]


@st.composite
def scenarios(draw):
    tp = draw(st.integers(2, 6))
    stages = draw(st.integers(1, 3))
    replicas = draw(st.integers(1, 4))
    headroom = draw(st.sampled_from([0.0, 0.05, 0.15, 0.3, 0.5]))
    racks = make_racks(replicas * stages, tp, headroom=headroom)
    gpus = [g for r in racks.values() for g in r.gpus]
    status = draw(st.lists(st.sampled_from(STATUSES), min_size=len(gpus), max_size=len(gpus)))
    gpu_status = {g: s for g, s in zip(gpus, status, strict=True) if s is not GpuStatus.HEALTHY}
    speed = {
        g: draw(st.sampled_from([0.7, 0.9, 1.0]))
        for g, s in gpu_status.items()
        if s is GpuStatus.DEGRADED
    }
    nodes = sorted({g[0] for g in gpus})
    dead = draw(st.sets(st.sampled_from(nodes), max_size=2)) if draw(st.booleans()) else set()
    live = frozenset(nodes) - dead if draw(st.booleans()) or dead else None
    pins = {}
    if draw(st.booleans()):
        pinned = draw(st.sets(st.sampled_from(gpus), max_size=3))
        pins = {g: draw(st.sampled_from([200.0, 650.0, 800.0, 5000.0])) for g in sorted(pinned)}
    cluster = ClusterState(racks, gpu_status, speed, live, pins)
    job = make_job(racks, tp, stages, min_tp=draw(st.integers(1, tp)), local_batch=draw(st.integers(1, 16)))
    return cluster, job


def _check_invariants(cluster: ClusterState, job: JobSpec, result: PlanResult) -> None:
    for rep, spec in zip(result.replicas, job.replicas, strict=True):
        for stage in rep.stages:
            assert all(cluster.usable(g) for g in stage.gpus)  # never a failed/drained GPU
            assert stage.tp_degree == len(stage.gpus) == len(set(stage.gpus))
            if stage.rack == spec.stages[stage.spec_stage].rack:
                usable = [g for g in spec.stages[stage.spec_stage].gpus if cluster.usable(g)]
                assert stage.tp_degree <= len(usable)
                assert list(stage.gpus) == usable[: stage.tp_degree]
        if rep.state is ReplicaState.DROPPED:
            assert rep.relative_throughput == 0 and rep.stages == ()
        else:
            assert rep.tp_degree >= job.min_tp
            assert 0 < rep.relative_throughput <= 1 and 1 <= rep.local_batch <= job.local_batch
    for rack in cluster.racks.values():
        caps = [result.power_caps.get(g, rack.tdp_w) for g in rack.gpus if cluster.usable(g)]
        assert all(rack.min_w <= c <= rack.max_w for c in caps)  # within the GPU's limits
        if not cluster.power_pins.keys() & set(rack.gpus):  # operator pins may overrule it
            assert sum(caps) <= rack.power_budget_w + 1e-6  # never above the rack budget
    for g, cap in result.power_caps.items():
        rack = cluster.racks[_rack_of(cluster, g)]
        assert cluster.usable(g) and cap != rack.tdp_w
        if g in cluster.power_pins:
            assert cap == min(max(cluster.power_pins[g], rack.min_w), rack.max_w)


def _rack_of(cluster: ClusterState, gpu) -> str:
    return next(name for name, r in cluster.racks.items() if gpu in r.gpus)


# derandomized: the same 300 scenarios every run, so CI does not depend on the draw; the
# one known counterexample of the policy order is pinned down below
@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(scenarios())
def test_invariants_and_policy_order(scenario):
    cluster, job = scenario
    results = {p: plan(cluster, job, policy=p) for p in Policy}
    for result in results.values():
        _check_invariants(cluster, job, result)
    ratio = {p: r.expected_throughput_ratio for p, r in results.items()}
    assert ratio[Policy.NTP_PW] >= ratio[Policy.NTP] - 1e-12
    assert ratio[Policy.NTP] >= ratio[Policy.DP_DROP] - 1e-12


@settings(max_examples=60, deadline=None)
@given(scenarios(), st.sampled_from(list(Policy)))
def test_same_input_same_plan(scenario, policy):
    cluster, job = scenario
    copy = ClusterState(
        dict(cluster.racks),
        dict(reversed(list(cluster.gpu_status.items()))),
        dict(cluster.gpu_speed),
        cluster.live_nodes,
        dict(cluster.power_pins),
    )
    job_copy = JobSpec(**{f: getattr(job, f) for f in job.__dataclass_fields__})
    assert plan(cluster, job, policy=policy) == plan(copy, job_copy, policy=policy)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 8), st.integers(1, 3), st.integers(1, 4), st.sampled_from(list(Policy)),
    st.integers(0, 3),
)
def test_fully_healthy_cluster_gets_identity_plan(tp, stages, replicas, policy, fewer_units):
    """Also when a unit family has fewer units than the stage has GPUs (64 heads on a
    72-GPU rack): the replica runs at that count T on the first T GPUs, at full speed and
    batch, unboosted (the rest are in-rack spares)."""
    racks = make_racks(replicas * stages, tp)
    full = max(1, tp - fewer_units)
    job = make_job(racks, tp, stages, units={"heads": full, "ffn": 128})
    result = plan(ClusterState(racks), job, policy=policy)
    assert result.power_caps == {} and result.reasons == ()
    assert result.expected_throughput_ratio == 1.0
    for rep, spec in zip(result.replicas, job.replicas, strict=True):
        assert rep.state is ReplicaState.HEALTHY and rep.tp_degree == full
        assert rep.local_batch == job.local_batch and rep.relative_throughput == 1.0
        assert [s.gpus for s in rep.stages] == [s.gpus[:full] for s in spec.stages]


@pytest.mark.parametrize("headroom", [0.0, 0.3])
def test_exhaustive_failure_patterns_of_a_four_gpu_rack(headroom):
    racks = make_racks(2, 4, headroom=headroom)
    job = make_job(racks, 4, min_tp=2)
    gpus = racks["r0"].gpus
    for pattern in itertools.product([GpuStatus.HEALTHY, GpuStatus.FAILED, GpuStatus.DRAINED], repeat=4):
        cluster = ClusterState(racks, {g: s for g, s in zip(gpus, pattern, strict=True) if s is not GpuStatus.HEALTHY})
        results = {p: plan(cluster, job, policy=p) for p in Policy}
        for result in results.values():
            _check_invariants(cluster, job, result)
        r = {p: x.expected_throughput_ratio for p, x in results.items()}
        assert r[Policy.NTP_PW] >= r[Policy.NTP] >= r[Policy.DP_DROP]
        usable = sum(s is GpuStatus.HEALTHY for s in pattern)
        expected_ntp = (usable / 4 if usable >= 2 else 0.0) + 1.0
        assert r[Policy.NTP] == pytest.approx(expected_ntp / 2)


def test_ntp_pw_not_worse_than_ntp_with_a_low_power_pin():
    # found by the property above with random draws: replica 0 loses a GPU in stage 2 and
    # has a 200 W pin (clamped to 350 W) in stage 0; ntp-pw ran stage 0 at TP 4 with the
    # slow GPU (0.75) where ntp runs TP 3 without it (0.875): ntp-pw now keeps the faster
    racks = make_racks(6, 4, headroom=0.0)
    cluster = ClusterState(racks, {("r2-n1", 1): GpuStatus.FAILED}, {}, None, {("r0-n1", 1): 200.0})
    job = make_job(racks, 4, 3, local_batch=1)
    ratio = {p: plan(cluster, job, policy=p).expected_throughput_ratio for p in (Policy.NTP_PW, Policy.NTP)}
    assert ratio[Policy.NTP_PW] >= ratio[Policy.NTP] - 1e-12 and ratio[Policy.NTP] == 0.875
