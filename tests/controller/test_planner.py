"""Unit tests of the NTP planner, one policy at a time (pure function, no I/O)."""

from __future__ import annotations

import pytest
from tpflex_controller.planner import (
    ClusterState,
    GpuStatus,
    JobOverrides,
    PlanningError,
    Policy,
    ReplicaState,
    plan,
)
from tpflex_proto.powermodel import DEFAULT_POWER_MODEL as MODEL

from tests.controller.planner_fixtures import (
    MAX_W,
    TDP,
    failed,
    make_job,
    make_rack,
    make_racks,
    state,
)


@pytest.mark.parametrize("policy", list(Policy))
def test_healthy_cluster_gets_identity_plan(policy):
    racks = make_racks(6)
    job = make_job(racks, 4, stages=2)
    result = plan(state(racks), job, policy=policy)
    assert result.power_caps == {} and result.reasons == ()
    assert result.expected_throughput_ratio == 1.0
    for rep, spec in zip(result.replicas, job.replicas, strict=True):
        assert rep.state is ReplicaState.HEALTHY and rep.tp_degree == 4 and rep.local_batch == 8
        assert [s.gpus for s in rep.stages] == [s.gpus for s in spec.stages]


def test_ntp_pw_boosts_to_the_smallest_whole_watt_that_keeps_pace():
    racks = {f"r{i}": make_rack(f"r{i}", 32, 4) for i in range(3)}
    job = make_job(racks, 32)
    lost = racks["r1"].gpus[5]
    result = plan(state(racks, gpu_status=failed(lost)), job)
    rep = result.replicas[1]
    assert rep.state is ReplicaState.DEGRADED and rep.tp_degree == 31
    assert lost not in rep.stages[0].gpus
    caps = set(result.power_caps.values())
    assert len(caps) == 1 and set(result.power_caps) == set(rep.stages[0].gpus)
    cap = caps.pop()
    need = 32 / 31
    assert MODEL.throughput(cap / TDP) >= need > MODEL.throughput((cap - 1) / TDP)
    assert rep.relative_throughput == 1.0 and rep.local_batch == 8
    assert result.expected_throughput_ratio == 1.0
    assert any("TP 31" in r and f"{cap:.0f} W" in r and "r1" in r for r in result.reasons)


def test_ntp_pw_limited_by_rack_budget_shrinks_the_batch():
    racks = {f"r{i}": make_rack(f"r{i}", 32, 4, headroom=0.0) for i in range(2)}
    job = make_job(racks, 32, local_batch=64)
    cluster = state(racks, gpu_status=failed(racks["r0"].gpus[0]))
    result = plan(cluster, job)
    rep = result.replicas[0]
    used_caps = [result.power_caps[g] for g in rep.stages[0].gpus]
    assert sum(used_caps) <= racks["r0"].power_budget_w
    assert all(TDP < c < TDP * 1.1 for c in used_caps)
    expected = 31 * MODEL.throughput(used_caps[0] / TDP) / 32
    assert rep.relative_throughput == pytest.approx(expected)
    assert plan(cluster, job, policy=Policy.NTP).replicas[0].relative_throughput < expected < 1
    assert rep.local_batch < 64
    assert any("needs" in r for r in result.reasons)


def test_ntp_pw_max_boost_falls_short_on_a_small_rack():
    racks = make_racks(3, 4)
    job = make_job(racks, 4)
    result = plan(state(racks, gpu_status=failed(racks["r2"].gpus[1])), job)
    rep = result.replicas[2]
    cap = TDP * MODEL.max_power_ratio
    assert set(result.power_caps.values()) == {cap} and cap <= MAX_W
    assert rep.relative_throughput == pytest.approx(3 * MODEL.throughput(MODEL.max_power_ratio) / 4)
    assert rep.local_batch == int(8 * rep.relative_throughput)


def test_ntp_pw_only_degraded_stage_is_reduced_and_boosted():
    racks = make_racks(4)
    job = make_job(racks, 4, stages=2)
    lost = racks["r1"].gpus[3]
    result = plan(state(racks, gpu_status=failed(lost)), job)
    rep = result.replicas[0]
    assert [s.tp_degree for s in rep.stages] == [4, 3]
    assert set(result.power_caps) == set(rep.stages[1].gpus)


def test_ntp_runs_every_stage_at_the_replica_minimum_without_boost():
    racks = make_racks(4)
    job = make_job(racks, 4, stages=2)
    result = plan(state(racks, gpu_status=failed(racks["r1"].gpus[0])), job, policy=Policy.NTP)
    rep = result.replicas[0]
    assert [s.tp_degree for s in rep.stages] == [3, 3]
    assert rep.stages[0].gpus == racks["r0"].gpus[:3]
    assert rep.stages[1].gpus == racks["r1"].gpus[1:4]
    assert rep.local_batch == 6 and rep.relative_throughput == 0.75
    assert result.power_caps == {}
    assert result.expected_throughput_ratio == pytest.approx((0.75 + 1) / 2)


def test_dp_drop_drops_the_replica():
    racks = make_racks(4)
    job = make_job(racks, 4)
    cluster = state(racks, gpu_status=failed(racks["r3"].gpus[2], status=GpuStatus.DRAINED))
    result = plan(cluster, job, policy=Policy.DP_DROP)
    assert [r.state for r in result.replicas] == [ReplicaState.HEALTHY] * 3 + [ReplicaState.DROPPED]
    dropped = result.replicas[3]
    assert dropped.stages == () and dropped.local_batch == 0 and dropped.tp_degree == 0
    assert result.expected_throughput_ratio == 0.75
    assert len(result.reasons) == 1 and "replica 3" in result.reasons[0] and "drained" in result.reasons[0]


def test_replica_below_min_tp_is_dropped_under_ntp_and_ntp_pw():
    racks = make_racks(2)
    job = make_job(racks, 4, min_tp=3)
    cluster = state(racks, gpu_status=failed(*racks["r0"].gpus[:2]))
    for policy in (Policy.NTP, Policy.NTP_PW):
        rep = plan(cluster, job, policy=policy).replicas[0]
        assert rep.state is ReplicaState.DROPPED and "min_tp 3" in rep.reason


def test_spare_moves_the_degraded_stage_and_drops_when_spares_run_out():
    racks = make_racks(6)
    racks_bad_spare = dict(racks)
    job = make_job(racks, 4, spares=("r4", "r5"))
    lost = (racks["r0"].gpus[0], racks["r1"].gpus[1], racks["r2"].gpus[2], racks["r5"].gpus[0])
    result = plan(state(racks_bad_spare, gpu_status=failed(*lost)), job, policy=Policy.SPARE)
    states = [r.state for r in result.replicas]
    assert states == [ReplicaState.ON_SPARE, ReplicaState.DROPPED, ReplicaState.DROPPED, ReplicaState.HEALTHY]
    moved = result.replicas[0].stages[0]
    assert moved.rack == "r4" and moved.tp_degree == 4 and moved.gpus == racks["r4"].gpus
    assert result.replicas[0].relative_throughput == 1.0
    assert any("spare rack r4" in r for r in result.reasons)


def test_dead_node_and_drained_gpu_are_never_used():
    racks = make_racks(2)
    job = make_job(racks, 4)
    live = frozenset(g[0] for r in racks.values() for g in r.gpus) - {"r0-n1"}
    cluster = ClusterState(
        racks, failed(racks["r1"].gpus[0], status=GpuStatus.DRAINED), live_nodes=live
    )
    result = plan(cluster, job)
    assert result.replicas[0].stages[0].gpus == racks["r0"].gpus[:2]
    assert result.replicas[1].stages[0].gpus == racks["r1"].gpus[1:]


def test_slow_gpu_is_boosted_under_ntp_pw_and_slows_its_replica_under_ntp():
    racks = {f"r{i}": make_rack(f"r{i}", 8) for i in range(2)}
    job = make_job(racks, 8)
    slow = racks["r0"].gpus[4]
    cluster = state(racks, gpu_status=failed(slow, status=GpuStatus.DEGRADED), gpu_speed={slow: 0.95})
    boosted = plan(cluster, job)
    assert boosted.replicas[0].tp_degree == 8 and boosted.replicas[0].relative_throughput == 1.0
    assert slow in boosted.power_caps
    plain = plan(cluster, job, policy=Policy.NTP)
    assert plain.replicas[0].relative_throughput == pytest.approx(0.95)
    assert any("0.95x speed" in r for r in plain.reasons)


def test_operator_power_pin_overrides_and_is_clamped():
    racks = make_racks(2)
    job = make_job(racks, 4)
    a, b = racks["r0"].gpus[0], racks["r1"].gpus[0]
    result = plan(state(racks, power_pins={a: 600.0, b: 5000.0}), job)
    assert result.power_caps == {a: 600.0, b: MAX_W}
    assert result.replicas[0].relative_throughput == pytest.approx(MODEL.throughput(600 / TDP))
    assert result.replicas[1].relative_throughput == 1.0
    assert sum("power pinned" in r for r in result.reasons) == 2


def test_tp_pin_caps_every_stage_and_is_boosted():
    racks = make_racks(4)
    job = make_job(racks, 4, stages=2)
    result = plan(state(racks), job, overrides=JobOverrides(pins={1: 2}))
    rep = result.replicas[1]
    assert [s.tp_degree for s in rep.stages] == [2, 2]
    assert all(g in result.power_caps for s in rep.stages for g in s.gpus)
    assert any("operator pin -> TP 2" in r for r in result.reasons)


@pytest.mark.parametrize(
    ("pin", "words"),
    [(0, ">= 1"), (5, "above the base TP"), (1, "below min_tp"), (3, "rack r0 has 2"), (4, "no units")],
)
def test_pins_that_cannot_hold_are_suspended_with_a_reason(pin, words):
    """A pin never makes the job unplannable: the replica is planned as if unpinned."""
    racks = make_racks(2)
    job = make_job(racks, 4, min_tp=2, units={"heads": 64} if pin != 4 else {"heads": 3})
    lost = failed(*racks["r0"].gpus[:2]) if pin == 3 else {}
    cluster = state(racks, gpu_status=lost)
    result = plan(cluster, job, overrides=JobOverrides(pins={0: pin}))
    assert [(p.replica, p.tp_degree) for p in result.suspended_pins] == [(0, pin)]
    assert words in result.suspended_pins[0].reason
    assert any("pin suspended" in r and words in r for r in result.reasons)
    unpinned = plan(cluster, job)
    assert result.replicas == unpinned.replicas and result.power_caps == unpinned.power_caps
    assert not any(g in lost for rep in result.replicas for st in rep.stages for g in st.gpus)


def test_a_pin_that_holds_is_not_suspended_and_a_failure_suspends_it():
    racks = make_racks(2)
    job = make_job(racks, 4)
    pinned = plan(state(racks), job, overrides=JobOverrides(pins={1: 4}))
    assert pinned.suspended_pins == () and pinned.replicas[1].tp_degree == 4
    gone = racks["r1"].gpus[2]
    for status in (GpuStatus.FAILED, GpuStatus.DRAINED):
        result = plan(state(racks, gpu_status=failed(gone, status=status)), job,
                      overrides=JobOverrides(pins={1: 4}))
        assert [p.tp_degree for p in result.suspended_pins] == [4]
        assert result.replicas[1].tp_degree == 3 and gone not in result.replicas[1].stages[0].gpus
        assert not result.same_decision(pinned)


def test_a_suspended_pin_releases_every_stage_not_only_the_short_one():
    """ntp-pw: stage 0 lost 3 GPUs (pin 6 cannot hold), stage 1 is whole; unpinned, stage 1
    runs at 8, not at the pin."""
    racks = make_racks(2, size=8)
    job = make_job(racks, 8, stages=2)
    cluster = state(racks, gpu_status=failed(*racks["r0"].gpus[:3]))
    result = plan(cluster, job, overrides=JobOverrides(pins={0: 6}))
    assert [s.tp_degree for s in result.replicas[0].stages] == [5, 8]
    assert result.replicas == plan(cluster, job).replicas


def test_unknown_rack_in_the_spec_raises():
    racks = make_racks(2)
    job = make_job(racks, 4)
    suspended = plan(state(racks), job, overrides=JobOverrides(pins={7: 2})).suspended_pins
    assert suspended[0].replica == 7 and "no such replica" in suspended[0].reason
    with pytest.raises(PlanningError, match="unknown rack"):
        plan(state({"r0": racks["r0"]}), job)


def test_units_cap_the_degree():
    racks = make_racks(2)
    job = make_job(racks, 4, units={"heads": 3, "ffn": 64})
    rep = plan(state(racks), job, policy=Policy.NTP).replicas[0]
    assert rep.tp_degree == 3 and rep.stages[0].gpus == racks["r0"].gpus[:3]


def test_in_rack_spares_cover_failures_and_boosts_are_relative_to_the_capped_degree():
    """14 heads on 16-GPU stages: T is 14, the last 2 GPUs of each rack spares. Two
    failures are covered by them (healthy, unboosted, full batch); three leave TP 13,
    which needs T/t = 14/13 speed (not base_tp/t = 16/13, beyond the power model)."""
    racks = {f"r{i}": make_rack(f"r{i}", 16, 4) for i in range(3)}
    job = make_job(racks, 16, units={"heads": 14, "ffn": 64})
    r1, r2 = racks["r1"].gpus, racks["r2"].gpus
    result = plan(state(racks, gpu_status=failed(r1[1], r1[6], r2[0], r2[3], r2[9])), job)
    healthy, spared, short = result.replicas
    assert healthy.state is ReplicaState.HEALTHY and healthy.stages[0].gpus == racks["r0"].gpus[:14]
    assert spared.state is ReplicaState.HEALTHY and spared.tp_degree == 14
    assert spared.stages[0].gpus == tuple(g for g in r1 if g not in (r1[1], r1[6]))[:14]
    assert spared.local_batch == 8 and spared.relative_throughput == 1.0
    assert any("rack r1 has 14/16 usable GPUs" in r and r.endswith("-> TP 14") for r in result.reasons)
    assert short.state is ReplicaState.DEGRADED and short.tp_degree == 13
    assert set(result.power_caps) == set(short.stages[0].gpus)
    cap = set(result.power_caps.values()).pop()
    need = 14 / 13
    assert MODEL.throughput(cap / TDP) >= need > MODEL.throughput((cap - 1) / TDP)
    assert short.relative_throughput == 1.0 and short.local_batch == 8
    assert result.expected_throughput_ratio == 1.0


def test_policy_precedence_argument_then_override_then_job():
    racks = make_racks(2)
    job = make_job(racks, 4)
    cluster = state(racks, gpu_status=failed(racks["r0"].gpus[0]))
    over = JobOverrides(policy=Policy.DP_DROP)
    assert plan(cluster, job).policy is Policy.NTP_PW
    assert plan(cluster, job, overrides=over).policy is Policy.DP_DROP
    assert plan(cluster, job, overrides=over, policy=Policy.NTP).policy is Policy.NTP


def test_racks_shared_by_stages_are_water_filled_within_budget():
    rack = make_rack("big", 8, headroom=-0.1)  # 7.2 x TDP for 8 GPUs: the budget binds
    racks = {"big": rack}
    from tpflex_controller.planner import JobSpec, ReplicaSpec, StageSpec

    job = JobSpec(
        "shared", 4,
        (ReplicaSpec((StageSpec("big", rack.gpus[:4]),)), ReplicaSpec((StageSpec("big", rack.gpus[4:]),))),
        {"heads": 8},
    )
    result = plan(state(racks, gpu_status=failed(rack.gpus[0], rack.gpus[7])), job)
    caps = list(result.power_caps.values())
    assert len(caps) == 6 and len(set(caps)) == 1
    assert TDP < caps[0] < TDP * MODEL.max_power_ratio
    assert sum(caps) <= rack.power_budget_w < sum(caps) + 6
