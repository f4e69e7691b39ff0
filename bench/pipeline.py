"""Pipeline stages under NTP: 2 replicas x PP 2 x TP 2 (8 gloo processes on CPU), the
built-in GPT split over the stages, 1F1B over 4 micro-batches. Measured in one run,
alternating the two layouts:
* uniform: every stage at T = 2, local batch 8 per replica;
* one stage degraded: stage 0 of replica 1 at T - 1 = 1 (plain NTP: the whole replica's
  batch shrinks to its slowest stage's t/T, 8 -> 4); replica 0 and stage 1 of replica 1
  keep their layouts.
``healthy_replica_step_ratio`` is replica 0's step time in the degraded job over the
uniform one. ``activation_bytes_per_step`` counts the bytes every stage root put on the
wire to another stage in the degraded job (activations forward, their gradients back),
counted at the send; ``activation_bytes_lower_bound`` is computed from the shapes alone:
each micro-batch's activation [rows, seq, hidden] fp32 must cross each stage boundary once
forward and once back. ``broadcast_bytes_per_step`` counts what each receiving root then
broadcast inside its own TP group (degree - 1 copies per tensor, counted at the
broadcast), against ``broadcast_bytes_bound`` from the shapes and degrees.
``all_pairs_bytes`` is what sending from every member of a stage to every member of the
next would cost (no broadcasts needed); ``all_pairs_ratio`` compares it with everything
the stages' transfers cost, broadcasts included. Timings on 2 oversubscribed cores are
noisy.

Prints one JSON line. Run: PYTHONPATH=. .venv/bin/python bench/pipeline.py
(``--quick``: one round of 1 measured step per layout, the same keys, seconds; for the
test suite, its figures are not the measurement's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tpflex_trainer.ntp.config import GPTConfig
from tpflex_trainer.ntp.layout import Member, ReplicaPlacement
from tpflex_trainer.ntp.optim import TrainSettings

from tests.trainer.harness import run_workers

CFG = GPTConfig(n_layers=4, hidden=128, n_heads=8, n_kv_groups=4, ffn_hidden=512, ffn_block=16,
                vocab=512, vocab_block=16, seq_len=64)
T, PP, BATCH, MICRO = 2, 2, 8, 4
ROUNDS, WARMUP, MEASURED = 2, 2, 6
MEMBERS = [Member(r, s, k) for r in range(2) for k in range(PP) for s in range(T)]


def _placements(degraded: bool) -> tuple[ReplicaPlacement, ...]:
    """Plain NTP: a replica's batch is its slowest stage's share t/T of the full one."""
    out = []
    for r in range(2):
        slots = [tuple(range(T - 1)) if degraded and r == 1 and k == 0 else tuple(range(T)) for k in range(PP)]
        batch = BATCH * min(len(s) for s in slots) // T
        out += [ReplicaPlacement(r, slots[k], batch, k) for k in range(PP)]
    return tuple(out)


MODES = {"uniform": _placements(False), "degraded": _placements(True)}


def _batch(rt, step: int):
    import torch

    gen = torch.Generator().manual_seed(step)
    rows = rt.layout.replica(rt.me.replica).local_batch
    tokens = torch.randint(0, CFG.vocab, (rows, CFG.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _worker(rank: int, world_size: int, rounds: int = ROUNDS, warmup: int = WARMUP,
            measured: int = MEASURED) -> dict:
    from tpflex_trainer.ntp.runtime import NtpRuntime

    me = MEMBERS[rank]
    world = {m: i for i, m in enumerate(MEMBERS)}
    rt = NtpRuntime(CFG, T, me, seed=0, stages=PP, train=TrainSettings(micro_batches=MICRO))
    rt.start(MODES["uniform"], world)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    sent = {m: 0 for m in MODES}
    broadcast = {m: 0 for m in MODES}
    for _ in range(rounds):
        for mode, plan in MODES.items():
            rt.apply_plan(plan, world)
            if not rt.active:
                continue
            for i in range(warmup + measured):
                before, before_bcast = rt.pipe.sent_bytes, rt.pipe.broadcast_bytes
                t0 = time.perf_counter()
                rt.train_step(*_batch(rt, i))
                if i >= warmup:
                    times[mode].append(time.perf_counter() - t0)
                    sent[mode] += rt.pipe.sent_bytes - before
                    broadcast[mode] += rt.pipe.broadcast_bytes - before_bcast
    rt.close()
    return {"member": tuple(me), "times": times, "sent": sent, "broadcast": broadcast}


def _step_s(results: dict, mode: str, replica: int | None = None) -> float:
    """Median step time; a replica's step is its slowest member's."""
    per_step: dict[int, float] = {}
    for r in results.values():
        if replica is None or r["member"][0] == replica:
            for i, t in enumerate(r["times"][mode]):
                per_step[i] = max(per_step.get(i, 0.0), t)
    return statistics.median(per_step.values())


def _bounds(plan: tuple[ReplicaPlacement, ...]) -> tuple[int, int, int]:
    """(lower bound, all-pairs bytes, broadcast bytes) per step from the shapes: per
    replica and stage boundary, each of its samples' activations once forward and once
    back; all pairs: from each member of one side to each of the other; broadcasts: the
    activation to the next stage's other members, the gradient to this stage's."""
    row = CFG.seq_len * CFG.hidden * 4
    lower = pairs = bcast = 0
    for r in {p.replica for p in plan}:
        stages = sorted((p for p in plan if p.replica == r), key=lambda p: p.stage)
        for a, b in zip(stages, stages[1:], strict=False):
            lower += 2 * a.local_batch * row
            pairs += 2 * a.local_batch * row * a.degree * b.degree
            bcast += a.local_batch * row * ((b.degree - 1) + (a.degree - 1))
    return lower, pairs, bcast


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round of 1 measured step (the same JSON keys)")
    rounds, warmup, measured = (1, 1, 1) if ap.parse_args(argv).quick else (ROUNDS, WARMUP, MEASURED)
    results = run_workers(_worker, len(MEMBERS), (rounds, warmup, measured), timeout_s=900)
    steps = rounds * measured
    lower, pairs, bcast_bound = _bounds(MODES["degraded"])
    uniform_healthy = _step_s(results, "uniform", replica=0)
    degraded_healthy = _step_s(results, "degraded", replica=0)
    measured = sum(r["sent"]["degraded"] for r in results.values()) // steps
    broadcast = sum(r["broadcast"]["degraded"] for r in results.values()) // steps
    print(json.dumps({
        "uniform_step_s": round(_step_s(results, "uniform"), 5),
        "one_stage_degraded_step_s": round(_step_s(results, "degraded"), 5),
        "healthy_replica_step_ratio": round(degraded_healthy / uniform_healthy, 4),
        "activation_bytes_per_step": int(measured),
        "activation_bytes_lower_bound": int(lower),
        "broadcast_bytes_per_step": int(broadcast),
        "broadcast_bytes_bound": int(bcast_bound),
        "all_pairs_bytes": int(pairs),
        "all_pairs_ratio": round(pairs / (measured + broadcast), 4),
        "uniform_activation_bytes_per_step": sum(r["sent"]["uniform"] for r in results.values()) // steps,
        "uniform_activation_bytes_lower_bound": _bounds(MODES["uniform"])[0],
        "uniform_broadcast_bytes_per_step": sum(r["broadcast"]["uniform"] for r in results.values()) // steps,
        "setup": f"gloo CPU, {len(MEMBERS)} procs, 2 replicas x PP{PP} x TP{T}, GPT {CFG.n_layers} layers "
                 f"hidden {CFG.hidden}, batch {BATCH}/replica in {MICRO} micro-batches; degraded: "
                 "stage 0 of replica 1 at TP1, its batch 4",
    }))


if __name__ == "__main__":
    main()
