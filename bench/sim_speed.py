"""tpflex-sim speed: 32K GPUs over 15 simulated days (Llama 3 rates, every policy), the full
paper sweep (`tpflex-sim paper`), and planner calls per second. Prints one JSON line.

Baseline measured in the same run: generating the same 15-day failure trace without
planning (`trace_only_s`), so the planner's share of the simulation is visible.
Goals (issue 6): sim_32k_15d_s <= 10, paper_sweep_s <= 60.

``--quick``: the same JSON keys from tiny sizes (2,112 GPUs over 1 day, a one-point sweep
in place of the paper's, the planner over 64 racks): seconds, for the test suite; its
figures are not the goals'.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from tpflex_controller.sim.cluster import SimCluster
from tpflex_controller.sim.config import PAPER_NVL32, SweepConfig
from tpflex_controller.sim.engine import make_trace, simulate
from tpflex_controller.sim.paper import paper_results
from tpflex_controller.sim.sweep import run_sweep


def full_replan_ms(count: int = 1024, runs: int = 15) -> tuple[float, float]:
    """plan() of a 1,024-replica job on 1,024 NVL72 racks (73,728 GPUs, 3 failed): median
    ms with the JobSpec reused (warm) and rebuilt for every call (cold). ``count`` racks
    and ``runs`` calls each make it smaller."""
    from tpflex_controller.planner import (
        ClusterState,
        GpuStatus,
        JobSpec,
        RackInfo,
        ReplicaSpec,
        StageSpec,
        plan,
    )

    racks = {}
    for r in range(count):
        gpus = tuple((f"r{r}-n{j}", i) for j in range(18) for i in range(4))
        racks[f"r{r}"] = RackInfo(f"r{r}", 72, 72 * 1100.0, 1000.0, 500.0, 1300.0, gpus)
    live = frozenset(g[0] for rack in racks.values() for g in rack.gpus)
    failed = {("r5-n2", 1): GpuStatus.FAILED, ("r7-n0", 0): GpuStatus.FAILED,
              (f"r{min(900, count - 1)}-n17", 3): GpuStatus.DRAINED}
    cluster = ClusterState(racks, failed, live_nodes=live)

    def job() -> JobSpec:
        reps = tuple(ReplicaSpec((StageSpec(n, tuple(list(r.gpus))),)) for n, r in racks.items())
        return JobSpec("big", 72, reps, {"heads": 128})

    warm_job, warm, cold = job(), [], []
    for _ in range(runs):
        started = time.perf_counter()
        plan(cluster, warm_job)
        warm.append(time.perf_counter() - started)
        fresh = job()
        started = time.perf_counter()
        plan(cluster, fresh)
        cold.append(time.perf_counter() - started)
    return sorted(warm)[runs // 2] * 1e3, sorted(cold)[runs // 2] * 1e3


class _Quick:
    """What ``--quick`` measures in place of the paper's sweep: one small sweep and trace."""

    def __init__(self, sweep, trace) -> None:
        self.sweep, self.tp64, self.no_headroom, self.blast = sweep, [], [], {"gpu": trace}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, seconds (the same JSON keys)")
    quick = ap.parse_args(argv).quick
    cfg = PAPER_NVL32
    if quick:
        cfg = replace(cfg, days=1.0, cluster=replace(cfg.cluster, gpus=2112, spares=2))
    started = time.perf_counter()
    trace = make_trace(SimCluster(cfg.cluster), cfg)
    trace_only_s = time.perf_counter() - started

    started = time.perf_counter()
    result = simulate(cfg)
    sim_s = time.perf_counter() - started

    started = time.perf_counter()
    if quick:
        paper = _Quick(run_sweep(SweepConfig(gpus=2048, domain_sizes=(32,), fractions=(0.002,), samples=1)),
                       result)
    else:
        paper = paper_results()
    paper_s = time.perf_counter() - started

    warm_ms, cold_ms = full_replan_ms(64, 3) if quick else full_replan_ms()
    print(json.dumps({
        "sim_32k_15d_s": round(sim_s, 3),
        "paper_sweep_s": round(paper_s, 3),
        "planner_calls_per_s": round(result.planner_calls / max(result.planner_seconds, 1e-9), 1),
        "planner_calls": result.planner_calls,
        "events": len(trace),
        "gpus": cfg.cluster.gpus,
        "policies": len(cfg.policies),
        "trace_only_s": round(trace_only_s, 3),
        "paper_sweep_rows": len(paper.sweep) + len(paper.tp64) + len(paper.no_headroom),
        "paper_traces": len(paper.blast),
        "plan_1024_nvl72_warm_ms": round(warm_ms, 2),
        "plan_1024_nvl72_cold_ms": round(cold_ms, 2),
        "goal_sim_32k_15d_s": 10,
        "goal_paper_sweep_s": 60,
    }))


if __name__ == "__main__":
    main()
