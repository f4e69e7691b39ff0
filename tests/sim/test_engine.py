"""The discrete-event engine and its use of the production planner."""

from __future__ import annotations

import random
from dataclasses import replace

import tpflex_controller.planner as planner_pkg
import tpflex_controller.sim.cluster as sim_cluster
from tpflex_controller.planner import ClusterState, GpuStatus, JobSpec, Policy, ReplicaSpec, plan
from tpflex_controller.sim.cluster import SimCluster, Snapshot
from tpflex_controller.sim.config import ClusterConfig, FailureConfig, Placement, SimConfig
from tpflex_controller.sim.engine import Sample, simulate, summarize
from tpflex_controller.sim.trace import sample_failed

SMALL = ClusterConfig(gpus=32 * 8 * 16 + 32 * 4, domain_size=32, pp=8, spares=4)


def test_simulator_calls_the_production_planner():
    assert sim_cluster.plan is planner_pkg.plan


def test_planning_only_affected_replicas_equals_planning_the_whole_job():
    sim = SimCluster(SMALL)
    rng = random.Random(11)
    whole = JobSpec(
        "sim", 32,
        tuple(ReplicaSpec(tuple(sim.stages[r * 8 + s] for s in range(8))) for r in range(SMALL.replicas)),
        {"heads": 128}, min_tp=SMALL.effective_min_tp, spare_racks=sim.spare_names,
    )
    for _ in range(5):
        failed = sample_failed(SMALL.gpus, 0.004, rng)
        status = dict.fromkeys((sim.keys[g] for g in failed), GpuStatus.FAILED)
        for policy in Policy:
            full = plan(ClusterState(sim.racks, status), whole, policy=policy)
            snap = sim.evaluate(failed, policy, Placement.UNPACKED, SMALL.spares)
            assert snap.throughput_ratio == full.expected_throughput_ratio
            assert snap.boosted_gpus == len(full.power_caps)


def test_summary_is_a_time_average():
    def snap(thr: float) -> Snapshot:
        return Snapshot(thr, 0, 0, 0, thr, 0.0, 0, thr < 1, 1)

    timeline = [Sample(0.0, 0, snap(1.0)), Sample(6.0, 3, snap(0.5)), Sample(18.0, 0, snap(1.0))]
    s = summarize(timeline, 24.0, SMALL)
    assert s["mean_throughput"] == (6 + 12 * 0.5 + 6) / 24
    assert s["paused_fraction"] == 0.5 and s["min_throughput"] == 0.5


def test_policies_spares_and_packing_on_one_trace():
    base = SimConfig(
        cluster=SMALL, failures=FailureConfig(rate_scale=20.0), days=4.0, seed=3,
    )
    unpacked = simulate(base)
    mean = {p: r.summary["mean_throughput"] for p, r in unpacked.runs.items()}
    assert mean[Policy.NTP_PW] >= mean[Policy.NTP] >= mean[Policy.DP_DROP]
    assert mean[Policy.SPARE] >= mean[Policy.DP_DROP]
    assert mean[Policy.DP_DROP] < 1.0 and unpacked.events > 10 and unpacked.planner_calls > 0
    packed = simulate(replace(base, placement=Placement.PACKED, policies=(Policy.DP_DROP,)))
    assert packed.runs[Policy.DP_DROP].summary["mean_throughput"] >= mean[Policy.DP_DROP]
    boosted = unpacked.runs[Policy.NTP_PW].summary
    assert boosted["boost_energy_fraction"] > 0 and boosted["perf_per_watt_ratio"] < 1.0
    seen = []
    simulate(replace(base, policies=(Policy.NTP,)), seen.append)
    assert seen[-1] == 1.0 and seen == sorted(seen)
