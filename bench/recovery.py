"""Recovery from a dead GPU, in-process, vs a checkpoint-restart of the same job.

One demo cluster (real etcd, tpflex-controller, 2 simulated agents of 4 GPUs) and one
8-process gloo job (2 replicas x TP 4, checkpoint every 10 steps) serve every run:

* **recovery** (5 runs): a GPU of the job fails (its rank's process is SIGKILLed, XID 79
  injected through its agent). Measured from the injection until *every* survivor has
  completed a training step at the new plan generation (TP 4+3). Phases, from the same
  injection: ``detection`` / ``plan_commit`` / ``power_applied`` (the controller's event
  for the new generation), ``reshard`` (the slowest survivor's plan application: rendezvous
  excluded, agreement + groups + transfer + rebuild included) and ``first_step_after``
  (the first survivor's first step). Then the GPU is repaired, the launcher starts a
  process for it and the job returns to 4+4 before the next run; each run fails another
  GPU (slots 1-3 of either rack) so flap damping does not stretch the repairs.
* **checkpoint restart** (3 runs, same job, same run of this script): every rank is
  killed, a fresh process is started for every GPU of the current plan (new rendezvous
  round), each loads the latest checkpoint, and the time is taken when every rank has
  completed its first step. Detection and re-planning are not included (they would come
  on top in a real restart-based recovery), so this is the restart's lower bound.

``regrouped_p50_s`` (not a phase of the issue's list): injection until the last survivor
has its new process group (failure noticed, groups aborted, plan received, rendezvous
and gloo initialisation done; the reshard comes next).
``speedup_vs_checkpoint_restart`` = checkpoint_restart_p50_s / recovery_p50_s.
Prints one JSON line. Run: PYTHONPATH=. .venv/bin/python bench/recovery.py
(``--quick``: one recovery and one checkpoint restart, 2 steps between events, the same
keys; for the test suite, its figures are not the measurement's).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tpflex_proto import codec, keys, planstore, types_pb2
from tpflex_trainer.demo.cluster import DemoPorts, PortsTaken, check_ports_free
from tpflex_trainer.demo.story import JOB, RACKS, Story, StoryConfig
from tpflex_trainer.demo.summary import phase_timings

RUNS = 5
RESTARTS = 3
FAIL_ORDER = [("node-1", 2), ("node-0", 1), ("node-1", 3), ("node-0", 2), ("node-1", 1)]
PHASES = ("detection", "plan_commit", "power_applied", "reshard", "first_step_after")
STEPS_BETWEEN = 4  # steps trained at a generation before the next event


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _free_base() -> int:
    for _ in range(50):
        base = random.randrange(20000, 32000, 20)
        try:
            check_ports_free(DemoPorts(base).all(len(RACKS)))
            return base
        except PortsTaken:
            continue
    raise RuntimeError("no free port range for the demo cluster")


class Bench:
    def __init__(self, workdir: Path) -> None:
        self.story = Story(StoryConfig(workdir=workdir, base_port=_free_base(), steps=10**6,
                                       fail_at_step=1, repair_at_step=2, phase_timeout_s=90,
                                       hold_for_repair=False),
                           progress=lambda _: None)
        self.generation = 1

    @property
    def launcher(self):
        return self.story.launcher

    def rank_of(self, gpu: tuple[str, int]) -> int:
        return self.launcher.gpus().index(gpu)

    def steps_since(self, since: float, generation: int) -> dict[int, list[dict]]:
        out: dict[int, list[dict]] = {}
        for r in self.launcher.records():
            if r["kind"] == "step" and r["t"] >= since and r["generation"] >= generation:
                out.setdefault(r["rank"], []).append(r)
        return out

    def wait_training(self, ranks: set[int], generation: int, since: float, steps: int = 1) -> float:
        """Until every rank in ``ranks`` has completed ``steps`` steps at ``generation``
        after ``since``; returns when the last one completed its first."""
        def done() -> bool:
            got = self.steps_since(since, generation)
            return all(len(got.get(r, [])) >= steps for r in ranks)

        self.story._until(done, f"ranks {sorted(ranks)} training at generation {generation}")
        got = self.steps_since(since, generation)
        return max(min(r["t"] for r in got[rank]) for rank in ranks)

    def plan_ranks(self, plan: types_pb2.Plan) -> set[int]:
        return {self.rank_of((g.node, g.index)) for rep in plan.replicas for st in rep.stages
                for g in st.gpus}

    def recovery_run(self, gpu: tuple[str, int]) -> tuple[float, dict[str, float]]:
        t_fail = time.time()
        self.launcher.kill_rank(gpu)
        self.story.inject(gpu[0], gpu[1], "xid79")
        plan = self.story.wait_plan(self.generation + 1)
        self.generation = plan.generation
        survivors = self.plan_ranks(plan)
        assert self.rank_of(gpu) not in survivors
        t_all = self.wait_training(survivors, self.generation, t_fail)
        run = self.story.run
        kvs, _ = self.story.cluster.etcd.get_prefix(keys.EVENTS)
        run.events = [codec.decode(types_pb2.Event, kv.value, kv.key) for kv in kvs]
        run.records = [r for r in self.launcher.records() if r["t"] >= t_fail]
        phases = phase_timings(run, self.generation, t_fail)
        split = {p: phases[p] for p in PHASES}
        # when the last survivor had its new process group (rendezvous done, reshard next)
        split["regrouped"] = max(r["at"] - r["reshard_s"] for r in run.records
                                 if r["kind"] == "applied" and r["generation"] == self.generation) - t_fail
        return t_all - t_fail, split

    def repair(self, gpu: tuple[str, int]) -> None:
        t = time.time()
        self.story.inject(gpu[0], gpu[1], "recover")
        plan = self.story.wait_plan(self.generation + 1)
        self.generation = plan.generation
        self.launcher.start_missing(plan)
        self.wait_training(self.plan_ranks(plan), self.generation, t, steps=STEPS_BETWEEN)

    def restart_run(self) -> float:
        plan = planstore.read_plan(self.story.cluster.etcd, JOB)
        t0 = time.time()
        self.launcher.restart_all(plan)
        t_all = self.wait_training(self.plan_ranks(plan), plan.generation, t0)
        self.wait_training(self.plan_ranks(plan), plan.generation, t0, steps=STEPS_BETWEEN)
        return t_all - t0


def main(argv: list[str] | None = None) -> int:
    global RUNS, RESTARTS, STEPS_BETWEEN
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="one recovery, one checkpoint restart, 2 steps between events (the same JSON keys)")
    if ap.parse_args(argv).quick:
        RUNS, RESTARTS, STEPS_BETWEEN = 1, 1, 2
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tpflex-bench-recovery-") as tmp:
        bench = Bench(Path(tmp))
        try:
            bench.story.start()
            bench.wait_training(set(range(8)), 1, 0.0, steps=STEPS_BETWEEN)
            recoveries, phases, restarts = [], [], []
            for i, gpu in enumerate(FAIL_ORDER[:RUNS]):
                seconds, split = bench.recovery_run(gpu)
                recoveries.append(seconds)
                phases.append(split)
                _say(f"run {i + 1}: GPU {gpu[0]}:{gpu[1]} failed, survivors training at "
                     f"generation {bench.generation} after {seconds:.3f}s {split}")
                bench.repair(gpu)
            t_restarts = time.time()
            for i in range(RESTARTS):
                restarts.append(bench.restart_run())
                _say(f"checkpoint restart {i + 1}: {restarts[-1]:.3f}s")
            # failures that tore a step: the survivors rolled back to the checkpoint
            rollbacks = len({r["generation"] for r in bench.launcher.records()
                             if r["kind"] == "applied" and r["source"] == "checkpoint"
                             and r["t"] < t_restarts})
        finally:
            bench.story.stop()
    recovery = statistics.median(recoveries)
    restart = statistics.median(restarts)
    print(json.dumps({
        "recovery_p50_s": round(recovery, 3),
        "phases_p50_s": {p: round(statistics.median(s[p] for s in phases), 3) for p in PHASES},
        "regrouped_p50_s": round(statistics.median(s["regrouped"] for s in phases), 3),
        "checkpoint_restart_p50_s": round(restart, 3),
        "speedup_vs_checkpoint_restart": round(restart / recovery, 2),
        "recovery_runs_s": [round(x, 3) for x in recoveries],
        "checkpoint_restart_runs_s": [round(x, 3) for x in restarts],
        "recovery_runs_rolled_back_to_checkpoint": rollbacks,
        "job": "2 replicas x TP 4, 8 gloo processes on CPU; 4+4 -> 4+3 per failure",
        "bench_wall_s": round(time.monotonic() - t_start, 1),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
