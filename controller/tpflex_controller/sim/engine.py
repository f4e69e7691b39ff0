"""Discrete-event replay of a failure trace through the production planner (pure: no I/O;
progress is reported through an optional callback)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from tpflex_controller.planner import Policy
from tpflex_controller.sim.cluster import SimCluster, Snapshot
from tpflex_controller.sim.config import Blast, ClusterConfig, SimConfig
from tpflex_controller.sim.trace import TraceEvent, failure_trace

Progress = Callable[[float], None]  # fraction done, 0..1


@dataclass(frozen=True, slots=True)
class Sample:
    """The state from ``time_h`` until the next sample."""

    time_h: float
    failed_gpus: int
    snapshot: Snapshot


@dataclass
class PolicyRun:
    policy: Policy
    timeline: list[Sample] = field(default_factory=list)
    summary: dict[str, float] = field(default_factory=dict)


@dataclass
class SimResult:
    config: SimConfig
    events: int
    runs: dict[Policy, PolicyRun]
    planner_calls: int
    planner_seconds: float


def make_trace(sim: SimCluster, cfg: SimConfig) -> list[TraceEvent]:
    def radius(gpu: int, blast: Blast) -> range:
        if blast is Blast.NODE:
            return sim.node_gpus(gpu)
        if blast is Blast.DOMAIN:
            return sim.domain_gpus(gpu)
        return range(gpu, gpu + 1)

    rng = random.Random(cfg.seed)
    start = -24.0 * cfg.warmup_days
    return failure_trace(cfg.failures, cfg.cluster.gpus, 24.0 * cfg.days, rng, radius, start)


def simulate(cfg: SimConfig, progress: Progress | None = None) -> SimResult:
    """Run the trace of ``cfg`` under each of its policies."""
    cfg = cfg.validate()
    sim = SimCluster(cfg.cluster)
    trace = make_trace(sim, cfg)
    runs: dict[Policy, PolicyRun] = {}
    calls, spent = 0, 0.0
    for i, policy in enumerate(cfg.policies):
        def step(frac: float, i: int = i) -> None:
            if progress is not None:
                progress((i + frac) / len(cfg.policies))

        run, n, dt = replay(sim, cfg, trace, policy, step)
        runs[policy] = run
        calls, spent = calls + n, spent + dt
    if progress is not None:
        progress(1.0)
    return SimResult(cfg, len(trace), runs, calls, spent)


def replay(
    sim: SimCluster, cfg: SimConfig, trace: list[TraceEvent], policy: Policy, step: Progress
) -> tuple[PolicyRun, int, float]:
    run = PolicyRun(policy)
    down: set[int] = set()
    calls, spent = 0, 0.0
    spares = cfg.cluster.spares
    i, n = 0, len(trace)
    while i < n:
        t = trace[i].time_h
        while i < n and trace[i].time_h == t:  # apply simultaneous events together
            ev = trace[i]
            (down.update if ev.failed else down.difference_update)(ev.gpus)
            i += 1
        before = sim.plan_seconds
        snap = sim.evaluate(down, policy, cfg.placement, spares)
        spent += sim.plan_seconds - before
        calls += snap.planner_calls
        run.timeline.append(Sample(max(t, 0.0), len(down), snap))
        if i % 64 == 0:
            step(i / n)
    run.timeline = _clip_warmup(run.timeline)
    run.summary = summarize(run.timeline, 24.0 * cfg.days, cfg.cluster)
    return run, calls, spent


def _clip_warmup(timeline: list[Sample]) -> list[Sample]:
    """Keep the state in force at t=0 and everything after it."""
    first = 0
    for k, s in enumerate(timeline):
        if s.time_h <= 0.0:
            first = k
    clipped = timeline[first:]
    if not clipped or clipped[0].time_h > 0.0:
        healthy = Snapshot(1.0, 0, 0, 0, 1.0, 0.0, 0, False, 0)
        clipped.insert(0, Sample(0.0, 0, healthy))
    return clipped


def summarize(timeline: list[Sample], horizon_h: float, cluster: ClusterConfig) -> dict[str, float]:
    """Time averages over [0, horizon)."""
    horizon_h = max(horizon_h, 1e-9)
    acc = dict.fromkeys(("thr", "power", "boost_w", "paused", "over", "failed"), 0.0)
    worst, spares_max = 1.0, 0
    for k, s in enumerate(timeline):
        end = timeline[k + 1].time_h if k + 1 < len(timeline) else horizon_h
        dt = max(0.0, min(end, horizon_h) - s.time_h)
        snap = s.snapshot
        acc["thr"] += snap.throughput_ratio * dt
        acc["power"] += snap.power_ratio * dt
        acc["boost_w"] += snap.boost_w * dt
        acc["paused"] += dt if snap.paused else 0.0
        worst = min(worst, snap.throughput_ratio)
        spares_max = max(spares_max, snap.spares_needed)
        acc["over"] += dt if s.failed_gpus > 0.001 * cluster.gpus else 0.0
        acc["failed"] += s.failed_gpus * dt
    mean = acc["thr"] / horizon_h
    power = acc["power"] / horizon_h
    job_w = cluster.replicas * cluster.replica_gpus * cluster.tdp_w
    return {
        "mean_throughput": mean,
        "loss": 1.0 - mean,
        "min_throughput": worst,
        "paused_fraction": acc["paused"] / horizon_h,
        "spares_needed": float(spares_max),
        "mean_power_ratio": power,
        "boost_energy_fraction": acc["boost_w"] / (acc["power"] * job_w) if power > 0 else 0.0,
        "mean_failed_fraction": acc["failed"] / horizon_h / cluster.gpus,
        "time_over_0_1pct_failed": acc["over"] / horizon_h,
        "perf_per_watt_ratio": mean / power if power > 0 else 0.0,
    }
