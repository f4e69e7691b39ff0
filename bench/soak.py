"""Chaos soak: a job of 8 ranks (2 ``tpflex-run`` nodes x 4) trained for ``--minutes`` (10)
against a real control plane (a 3-member etcd cluster, two controllers, one simulated
agent per node) while random faults hit it, one at a time, each followed by the job's
return to full health:

- ``rank_sigkill``: a training rank is SIGKILLed (tpflex-run restarts it; a soft failure);
- ``rank_hang``: a training rank is frozen (SIGSTOP) while its peers wait for it in a
  collective; tpflex-run finds its beats stopped and kills it, then restarts it;
- ``xid79``: a GPU falls off the bus through its agent's fault injection, its rank dies
  with it; the GPU is repaired a few seconds later;
- ``agent_freeze``: a node's agent is frozen (SIGSTOP) for 0.5-1.5 s, within its 2 s lease
  (a longer freeze loses the node: the job drops that replica and trains on a smaller
  global batch, no longer the baseline's data);
- ``controller_leader_kill``: the leading controller is SIGKILLed (the standby takes over)
  and restarted;
- ``etcd_member_kill``: one etcd member is SIGKILLed and restarted.

Repeated soft failures of one GPU are the soak's doing, so its controllers never drain a
GPU for them (``[liveness] max_soft_failures`` 1000; tests/controller cover the drain), and
its launchers cap their restart backoff at 2 s (``--backoff-max-s``; ``--max-restarts``
1000): tpflex-run doubles a rank's restart delay with every restart in its window, up to
30 s by default, so a soak that re-kills one rank eight times in five minutes would
measure the backoff it provoked, not the recovery (the job waits for the restarted rank:
its GPU stays in the plan). The pauses are then the recovery's own.

Then every rank stops at the same step N, and two references are trained to N without
faults: the **same-layout reference** (``bench/soak_replay.py``: the chaos run's rounds
replayed in 8 gloo processes, each round's recorded plan from the step the chaos run
resumed at, the ranks restarted in a round starting empty as they did; when every round
used one layout this is the fixed-layout baseline itself) and the **fixed-layout
baseline** (the same job through a fresh control plane, never re-planned; ``--baseline
replay``: its arithmetic, one replay round of every step in the job's first plan). A rank death, a
hang, the controller or etcd faults recover bit for bit; an XID 79 re-plans the degraded
replica at TP 3 on fewer samples (``local_batch x`` its throughput), whose arithmetic only
the same-layout reference repeats. Neither is independent of the runtime: the replay runs
the same ``NtpRuntime``, and the baseline sees other samples once a step is degraded. So an
**oracle** (``bench/soak_oracle.py``) checks every plan generation's first steps against
the single-process reference (``ntp/reference.py``: a dense model, ``torch.optim.Adam``):
the ranks dump the whole job state at the start of each generation's first round and
``DUMP_STEPS`` steps later (``TPFLEX_DEMO_DUMP_DIR``, ``demo/dumps.py``), the reference
continues from the first dump on each step's whole global batch, and the losses every rank
recorded and the later dump (weights, both moments, every replica) must be within 1e-5
(relative L2); every layout change (a generation whose degrees or global batch differ from
the one before: an XID 79, a drain, a repair) must have been checked. With
``--reference``, stderr also gives each run against the single-process reference on its
own per-step batches. Prints one JSON line:
``faults_injected``, ``faults_by_kind``, ``lost_steps`` (completed steps that had to be
run again, whatever the round that went back: live, from a checkpoint, or a second ``init``
round that started the job again from its seed), ``weights_rel_l2`` (final weights vs the same-layout reference, relative L2
over the whole model: what the faults cost; null when the run cannot be replayed, e.g.
after a checkpoint restart), ``weights_rel_l2_vs_fixed_layout`` (vs the fixed-layout
baseline: what the layout changes cost on top), ``max_pause_s`` and ``p50_pause_s`` (per
fault: the gap in the job's progress around it), ``checkpoint_restarts`` (rounds that
loaded a checkpoint), ``torn_steps_replayed`` (steps some ranks had applied and others not
when a rank died, run again from the undo state without a checkpoint),
``layout_changes_checked`` (layout changes the oracle checked) and ``oracle_max_rel_l2``
(the largest relative L2 of any window it checked: losses, replicas' entry states, exit
states; null when none). An oracle miss (beyond 1e-5, or a layout change left unchecked)
is logged and the soak exits 1 after the JSON line. Details to stderr;
``--keep`` keeps the work directory (with ``plans.json``, the recorded plans). The
cluster, the job and the faults: ``bench/soak_chaos.py``; the replay:
``bench/soak_replay.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from tpflex_trainer.demo.cluster import DemoCluster
from tpflex_trainer.demo.data import global_batch
from tpflex_trainer.demo.dumps import DUMP_STEPS
from tpflex_trainer.demo.model import DEMO_ADAM, DEMO_MODEL, DEMO_SEED
from tpflex_trainer.ntp.adapter import as_adapter
from tpflex_trainer.ntp.checkpoint import read_full_state
from tpflex_trainer.ntp.reference import reference_state, state_rel_l2

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.soak_replay, tests.trainer.harness
from bench.soak_chaos import (  # noqa: E402
    ALL_GPUS,
    KINDS,
    LOCAL_BATCH,
    RACKS,
    SETTLE_S,
    Chaos,
    Records,
    SoakCluster,
    free_demo_ports,
    log,
    record_plans,
    run_job,
    wait,
)
from bench.soak_oracle import layout_changes, run_oracle, summary, warm_up  # noqa: E402
from bench.soak_replay import ReplayUnsupported, Round, one_layout, replay, rounds_from  # noqa: E402


def pauses(records: list[dict], faults: list[dict]) -> list[float]:
    """Per fault: the gap between the job's last progress before it and its first after."""
    firsts: dict[int, float] = {}
    for r in records:
        if r["kind"] == "step":
            firsts[r["step"]] = min(firsts.get(r["step"], r["t"]), r["t"])
    timeline = sorted((t, s) for s, t in firsts.items())
    out = []
    for f in faults:
        before = max((t for t, _ in timeline if t <= f["at"]), default=None)
        after = min((t for t, _ in timeline if t > f["at"]), default=None)
        if before is not None and after is not None:
            out.append(after - before)
    return out


def job_done(steps: list[dict]) -> int:
    """The newest step the job completed (every active rank applied its update), from
    step records: a step below the newest one recorded (its collectives needed every
    member past the update before it), or one every active rank of its generation recorded.
    Steps some ranks recorded and others never applied (a torn step) are not complete."""
    if not steps:
        return -1
    ranks: dict[tuple[int, int], set[int]] = {}
    need: dict[tuple[int, int], int] = {}
    for r in steps:
        key = (r["step"], r["generation"])
        ranks.setdefault(key, set()).add(r["rank"])
        need[key] = sum(sum(d) if isinstance(d, list) else d for d in r["degrees"])
    complete = [s for (s, g), who in ranks.items() if len(who) >= need[(s, g)]]
    return max(max(complete, default=-1), max(r["step"] for r in steps) - 1)


def lost_steps(records: list[dict]) -> tuple[int, int, int]:
    """(completed steps run again, rounds that loaded a checkpoint, torn steps replayed):
    each round a rank applied after start resumes at step s; steps the job had completed
    beyond s-1 (the furthest step it completed before the round, whichever round completed
    it) were lost, whatever the round's source: a live round, a checkpoint, or a second
    ``init`` round (the job started again from step 0); a step some ranks had recorded but
    the job had not completed (torn) and that is run again is a replay, not a loss."""
    lost, restarts, torn, seen = 0, 0, 0, set()
    steps = sorted((r for r in records if r["kind"] == "step"), key=lambda r: r["t"])
    for r in sorted((r for r in records if r["kind"] == "applied"), key=lambda r: r["t"]):
        key = (r["generation"], r.get("epoch", 0))
        if key in seen or r["source"] == "idle":
            continue
        seen.add(key)
        before = [s for s in steps if s["t"] < r["t"]]
        done = job_done(before)
        recorded = max((s["step"] for s in before), default=-1)
        lost += max(0, done + 1 - r["step"])
        torn += max(0, recorded - max(done, r["step"] - 1))
        restarts += r["source"] == "checkpoint"
    return lost, restarts, torn


def vs_reference(records: list[dict], state: dict) -> float:
    """Relative L2 of a run's final weights against the single-process reference trained
    on the run's own per-step global batches (the same data)."""
    batch = {r["step"]: r["global_batch"] for r in records if r["kind"] == "step"}
    batches = [global_batch(DEMO_MODEL, s, batch[s]) for s in range(len(batch))]
    _, ref = reference_state(DEMO_MODEL, DEMO_SEED, batches, lr=DEMO_ADAM.lr, betas=DEMO_ADAM.betas,
                             eps=DEMO_ADAM.eps)
    return state_rel_l2(state["param"], ref["param"])


def chaos_run(work: Path, minutes: float, rng: random.Random, kinds: tuple[str, ...], max_faults: int = 0,
              pace_s: float = 0.0, preload: bool = False, checkpoint_every: int = 200) -> dict:
    cluster = SoakCluster(free_demo_ports(), RACKS, work / "cluster")
    stop_file = work / "stop-at"
    procs = []
    stop_plans = threading.Event()
    try:
        cluster.start()
        threading.Thread(target=record_plans, args=(cluster, stop_plans), daemon=True).start()
        threading.Thread(target=warm_up, daemon=True).start()  # the oracle's reference, later
        spec, procs = run_job(cluster, work, 10**9, stop_file=stop_file, checkpoints=True, pace_s=pace_s,
                              preload=preload, checkpoint_every=checkpoint_every, dumps=work / "dumps")
        records = Records(work / "steps.jsonl")
        chaos = Chaos(cluster, work, records, rng, kinds)
        wait(lambda: records.progress() >= 5, 240, "the job's first steps")
        t_end = time.monotonic() + minutes * 60
        while time.monotonic() < t_end and not 0 < max_faults <= len(chaos.faults):
            fault = chaos.inject()
            wait(lambda f=fault: chaos.healthy(f["done_at"] + SETTLE_S), 180, f"recovery from {fault['kind']}")
            time.sleep(rng.uniform(0.2, 1.0))
        stop_at = records.progress() + 10  # ahead of every rank: all of them are healthy now
        stop_file.write_text(str(stop_at))
        log(f"faults over; every rank stops at step {stop_at}")
        statuses = [p.wait(timeout=300) for p in procs]
        if statuses != [0, 0]:
            raise RuntimeError(f"launchers exited {statuses}; logs in {work}")
        plans = dict(cluster.__dict__.get("plans", {}))
        (work / "plans.json").write_text(json.dumps({g: p.SerializeToString().hex() for g, p in plans.items()}))
        return dict(spec=spec, steps=stop_at, faults=chaos.faults, records=records.poll(), plans=plans)
    finally:
        stop_plans.set()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        cluster.stop()


def replay_baseline(work: Path, chaos: dict) -> None:
    """The fixed-layout baseline without a control plane (``--baseline replay``): one
    ``soak_replay`` round of all the steps in the job's first plan (every GPU), every rank
    starting empty, each step on the full global batch: the arithmetic of the job never
    re-planned (the same runtime, the same per-replica split of each step's batch), in 8
    forkserver gloo processes instead of a second cluster and 8 freshly started ranks."""
    plans = chaos["plans"]
    first = min(plans, default=None)
    if first is None or {(g.node, g.index) for rep in plans[first].replicas if rep.tp_degree
                         for st in rep.stages for g in st.gpus} != ALL_GPUS:
        raise RuntimeError(f"no recorded plan places every GPU (generations {sorted(plans)})")
    ranks = tuple(range(len(ALL_GPUS)))
    _lean_forkserver()
    replay(chaos["spec"], [Round(0, chaos["steps"], first, plans[first].SerializeToString(), ranks)], {},
           work / "final")


def _lean_forkserver() -> None:
    """The replays' workers need torch and the runtime, not the Hugging Face model families
    the test session's list adds (tests/support/forkserver.py): ~5 s of CPU less in this
    process's one forkserver. Set after the harness (which sets that list on import)."""
    import multiprocessing as mp

    import tests.trainer.harness  # noqa: F401

    mp.get_context("forkserver").set_forkserver_preload(
        ["torch", "torch.distributed", "tpflex_trainer.ntp.runtime", "tpflex_trainer.demo.model",
         "tpflex_trainer.hooks.plans", "tpflex_trainer.ntp.plan_adapter"])


def baseline_run(work: Path, steps: int, preload: bool = False) -> None:
    cluster = DemoCluster(free_demo_ports(), RACKS, work / "cluster")
    procs = []
    try:
        cluster.start()
        _, procs = run_job(cluster, work, steps, stop_file=None, checkpoints=False, preload=preload)
        statuses = [p.wait(timeout=3600) for p in procs]
        if statuses != [0, 0]:
            raise RuntimeError(f"baseline launchers exited {statuses}; logs in {work}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        cluster.stop()


def baseline_records(work: Path, how: str, steps: int) -> list[dict]:
    """The baseline's step records (a replayed one trained every step on the full batch)."""
    if how == "replay":
        return [{"kind": "step", "step": s, "global_batch": LOCAL_BATCH * len(RACKS)} for s in range(steps)]
    return Records(work / "baseline" / "steps.jsonl").poll()


def round_divergences(records: list[dict], replayed: list[dict]) -> list[dict]:
    """The rounds (rank, generation, epoch, step) whose first step started from another
    state in the chaos run than in the replay (``entered`` records against the replay's
    digests), oldest step first; rounds only one side recorded are left out. Pure."""
    key = lambda r: (r["rank"], r["generation"], r.get("epoch", 0), r["step"])  # noqa: E731
    theirs = {key(r): r for r in replayed}
    out = []
    for r in records:
        if r["kind"] == "entered" and key(r) in theirs and theirs[key(r)]["digest"] != r["digest"]:
            t = theirs[key(r)]
            out.append({"rank": r["rank"], "generation": r["generation"], "epoch": r.get("epoch", 0),
                        "step": r["step"], "same_units": t["units"] == r["units"],
                        "units": r["units"], "replay_units": t["units"]})
    return sorted(out, key=lambda d: (d["step"], d["rank"]))


def same_layout_l2(work: Path, chaos: dict, adapter, state_c: dict, state_b: dict) -> float | None:
    """The chaos run's final weights against the same-layout reference (``soak_replay``):
    the fixed-layout baseline itself when every round used one layout, else the replay of
    the chaos run's rounds. None (and why, on stderr) when the run cannot be replayed."""
    try:
        rounds = rounds_from(chaos["records"], chaos["plans"], chaos["steps"])
    except ReplayUnsupported as exc:
        log(f"no same-layout reference: {exc}")
        return None
    if one_layout(rounds):
        log(f"one layout in all {len(rounds)} rounds: the fixed-layout baseline is the same-layout reference")
        return state_rel_l2(state_c["param"], state_b["param"])
    batches = {r["step"]: r["global_batch"] for r in chaos["records"] if r["kind"] == "step"}
    log(f"replaying {len(rounds)} rounds ({sum(1 for r in rounds if r.fresh)} with restarted ranks)")
    _lean_forkserver()
    (work / "replay-digests").mkdir()
    replay(chaos["spec"], rounds, batches, work / "replay", digest_dir=work / "replay-digests")
    theirs = [json.loads(line) for f in sorted((work / "replay-digests").glob("*.jsonl"))
              for line in f.read_text().splitlines()]
    for d in round_divergences(chaos["records"], theirs)[:8]:
        log(f"round state differs from the replay's: {d}")
    step_r, state_r = read_full_state(work / "replay", adapter)
    if step_r != chaos["steps"]:
        raise RuntimeError(f"the replay ended at step {step_r}, the chaos run at {chaos['steps']}")
    return state_rel_l2(state_c["param"], state_r["param"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="how long faults hit the job (10)")
    ap.add_argument("--seed", type=int, default=None, help="fault schedule seed (random)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"fault kinds, comma-separated ({','.join(KINDS)})")
    ap.add_argument("--faults", type=int, default=0,
                    help="stop after this many faults, before --minutes if sooner (0: no limit)")
    ap.add_argument("--step-min-s", type=float, default=0.0,
                    help="pace the chaos run's steps (fewer steps for the baseline to replay; 0: unpaced)")
    ap.add_argument("--baseline", choices=("cluster", "replay"), default="cluster",
                    help="the fixed-layout baseline: the job on a fresh control plane (cluster), or its "
                         "arithmetic replayed in 8 gloo processes in the first plan (replay: no control "
                         "plane, no process start-up; the in-suite soak's)")
    ap.add_argument("--preload", action="store_true",
                    help="tpflex-run --preload: ranks forked from a zygote that imported the worker's modules "
                         "(starts and restarts skip the imports: shorter rejoin pauses; docs/launch.md)")
    ap.add_argument("--checkpoint-every", type=int, default=200,
                    help="the chaos run's checkpoint interval in steps (200; the in-suite soak's is shorter, so "
                         "that a checkpoint restart can happen in it)")
    ap.add_argument("--reference", action="store_true",
                    help="also compare each run with the single-process reference on its own batches "
                         "(stderr; minutes for thousands of steps)")
    ap.add_argument("--quick", action="store_true",
                    help="the smallest meaningful soak: one rank SIGKILL, paced steps, the replay baseline, "
                         "preloaded ranks (minutes, not seconds: the suite runs tests/reliability/test_soak.py)")
    args = ap.parse_args(argv)
    if args.quick:
        args.faults, args.kinds, args.step_min_s, args.baseline, args.preload = 1, "rank_sigkill", 0.4, "replay", True
        args.checkpoint_every = 20
    if not args.minutes > 0:
        ap.error("--minutes: must be > 0")
    if args.faults < 0:
        ap.error("--faults: must be >= 0")
    if args.checkpoint_every < 1:
        ap.error("--checkpoint-every: must be >= 1")
    if not 0 <= args.step_min_s <= 10:
        ap.error("--step-min-s: must be within [0, 10]")
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if not kinds or set(kinds) - set(KINDS):
        ap.error(f"--kinds: choose from {', '.join(KINDS)}, got {args.kinds!r}")
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    work = Path(tempfile.mkdtemp(prefix="tpflex-soak-"))
    log(f"work={work} seed={seed} minutes={args.minutes}")
    t0 = time.monotonic()
    chaos = chaos_run(work / "chaos", args.minutes, random.Random(seed), kinds, args.faults, args.step_min_s,
                      args.preload, args.checkpoint_every)
    t1 = time.monotonic()
    (work / "baseline").mkdir()
    if args.baseline == "replay":
        replay_baseline(work / "baseline", chaos)
    else:
        baseline_run(work / "baseline", chaos["steps"], args.preload)
    adapter = as_adapter(DEMO_MODEL, chaos["spec"].base_tp)
    step_c, state_c = read_full_state(work / "chaos" / "final", adapter)
    step_b, state_b = read_full_state(work / "baseline" / "final", adapter)
    if step_c != step_b:
        raise RuntimeError(f"the runs ended at steps {step_c} and {step_b}")
    lost, restarts, torn = lost_steps(chaos["records"])
    gaps = pauses(chaos["records"], chaos["faults"])
    t2 = time.monotonic()
    same_layout = same_layout_l2(work, chaos, adapter, state_c, state_b)
    t3 = time.monotonic()
    checks = run_oracle(work / "chaos" / "dumps", chaos["records"], DEMO_MODEL, adapter, DEMO_ADAM, DUMP_STEPS,
                        keep=args.keep)
    changes = layout_changes(chaos["records"])
    n_checked, oracle_worst, misses = summary(checks, changes)
    for c in checks:
        log(f"oracle: generation {c.generation} epoch {c.epoch} steps {c.start}..{c.start + DUMP_STEPS - 1}: "
            + (f"rel L2 {c.rel_l2:.3g}" if c.checked else f"not checked ({c.why})"))
    log(f"steps={chaos['steps']} chaos_s={t1 - t0:.0f} baseline_s={t2 - t1:.0f} replay_s={t3 - t2:.0f} "
        f"oracle_s={time.monotonic() - t3:.0f} layout_changes={changes} pauses={[round(g, 2) for g in gaps]}")
    if args.reference:  # e.g. after XID 79 faults (the data differed): how far each run is
        log(f"vs the single-process reference on each run's own batches: chaos "
            f"{vs_reference(chaos['records'], state_c):.3g} baseline "
            f"{vs_reference(baseline_records(work, args.baseline, chaos['steps']), state_b):.3g}")
    print(json.dumps({
        "faults_injected": len(chaos["faults"]),
        "faults_by_kind": dict(sorted(Counter(f["kind"] for f in chaos["faults"]).items())),
        "lost_steps": lost,
        "weights_rel_l2": same_layout,
        "weights_rel_l2_vs_fixed_layout": state_rel_l2(state_c["param"], state_b["param"]),
        "max_pause_s": round(max(gaps), 3) if gaps else 0.0,
        "p50_pause_s": round(statistics.median(gaps), 3) if gaps else 0.0,
        "checkpoint_restarts": restarts,
        "torn_steps_replayed": torn,
        "layout_changes_checked": n_checked,
        "oracle_max_rel_l2": oracle_worst,
    }))
    for miss in misses:
        log(f"oracle miss: {miss}")
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
