"""tpflex-sim speed: 32K GPUs over 15 simulated days (Llama 3 rates, every policy), the full
paper sweep (`tpflex-sim paper`), and planner calls per second. Prints one JSON line.

Baseline measured in the same run: generating the same 15-day failure trace without
planning (`trace_only_s`), so the planner's share of the simulation is visible.
Goals (issue 6): sim_32k_15d_s <= 10, paper_sweep_s <= 60.
"""

from __future__ import annotations

import json
import time

from tpflex_controller.sim.cluster import SimCluster
from tpflex_controller.sim.config import PAPER_NVL32
from tpflex_controller.sim.engine import make_trace, simulate
from tpflex_controller.sim.paper import paper_results


def main() -> None:
    cfg = PAPER_NVL32
    started = time.perf_counter()
    trace = make_trace(SimCluster(cfg.cluster), cfg)
    trace_only_s = time.perf_counter() - started

    started = time.perf_counter()
    result = simulate(cfg)
    sim_s = time.perf_counter() - started

    started = time.perf_counter()
    paper = paper_results()
    paper_s = time.perf_counter() - started

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
        "goal_sim_32k_15d_s": 10,
        "goal_paper_sweep_s": 60,
    }))


if __name__ == "__main__":
    main()
