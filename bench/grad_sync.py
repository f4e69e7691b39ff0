"""Gradient sync across TP degrees: step time of a healthy replica with the nonuniform
sync (job at TP 4+3, plain-NTP batches 4 and 3) vs the same job at uniform TP 4+4 (where
the sync is plain DDP: one bucketed all-reduce per core pair), measured in one run with
8 gloo processes on CPU, alternating the two modes. Also the pre-sync gradient bytes the
healthy replica moves per step vs the lower bound (t_r - t_min) / t_r of its gradient.

Prints one JSON line. Run: PYTHONPATH=. .venv/bin/python bench/grad_sync.py
(``--quick``: one round of 2 measured steps per mode, the same keys, seconds; for the
test suite, its figures are not the measurement's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tpflex_trainer.ntp.config import GPTConfig, param_specs
from tpflex_trainer.ntp.layout import Member, ReplicaPlacement

from tests.trainer.harness import run_workers

CFG = GPTConfig(n_layers=2, hidden=128, n_heads=8, n_kv_groups=4, ffn_hidden=512, ffn_block=16,
                vocab=512, vocab_block=16, seq_len=64)
ROUNDS, WARMUP, MEASURED = 3, 3, 12
BUCKET_BYTES = 512 * 1024  # ~4 buckets: lets the moves and all-reduces overlap backward
UNIFORM = (ReplicaPlacement(0, (0, 1, 2, 3), 4), ReplicaPlacement(1, (0, 1, 2, 3), 4))
NONUNIFORM = (ReplicaPlacement(0, (0, 1, 2, 3), 4), ReplicaPlacement(1, (0, 1, 2), 3))
MEMBERS = [Member(r, s) for r in range(2) for s in range(4)]


def _batch(rt, step: int):
    import torch

    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, CFG.vocab, (rt.layout.replica(rt.me.replica).local_batch, CFG.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _worker(rank: int, world_size: int, rounds: int = ROUNDS, warmup: int = WARMUP,
            measured: int = MEASURED) -> dict:
    from tpflex_trainer.ntp.runtime import NtpRuntime

    me = MEMBERS[rank]
    world = {m: i for i, m in enumerate(MEMBERS)}
    rt = NtpRuntime(CFG, 4, me, seed=0, bucket_bytes=BUCKET_BYTES)
    rt.start(UNIFORM, world)
    times: dict[str, list[float]] = {"uniform": [], "nonuniform": []}
    finish: dict[str, list[float]] = {"uniform": [], "nonuniform": []}
    sent = {"uniform": 0, "nonuniform": 0}
    for _ in range(rounds):
        for mode, plan in (("uniform", UNIFORM), ("nonuniform", NONUNIFORM)):
            rt.apply_plan(plan, world)
            if not rt.active:
                continue
            for i in range(warmup + measured):
                before = rt.sync.sent_bytes
                t0 = time.perf_counter()
                rt.train_step(*_batch(rt, i))
                if i >= warmup:
                    times[mode].append(time.perf_counter() - t0)
                    finish[mode].append(rt.sync.finish_seconds)
                    sent[mode] += rt.sync.sent_bytes - before
    rt.close()
    return {"member": tuple(me), "times": times, "finish": finish, "sent": sent}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round of 2 measured steps (the same JSON keys)")
    rounds, warmup, measured = (1, 1, 2) if ap.parse_args(argv).quick else (ROUNDS, WARMUP, MEASURED)
    results = run_workers(_worker, len(MEMBERS), (rounds, warmup, measured), timeout_s=600)
    healthy = [r for r in results.values() if r["member"][0] == 0]
    uniform = statistics.median(t for r in healthy for t in r["times"]["uniform"])
    nonuniform = statistics.median(t for r in healthy for t in r["times"]["nonuniform"])
    sync_wait = {
        mode: round(statistics.median(t for r in healthy for t in r["finish"][mode]), 5)
        for mode in ("uniform", "nonuniform")
    }
    steps = rounds * measured
    grad_bytes = sum(r["sent"]["nonuniform"] for r in healthy) / steps
    sharded = sum(4 * s.shape[0] * s.row_numel for s in param_specs(CFG) if s.sharded)
    t_r, t_min = 4, 3
    lower = sharded * (t_r - t_min) / t_r
    print(json.dumps({
        "step_time_ratio": round(nonuniform / uniform, 4),
        "grad_bytes_per_step": int(grad_bytes),
        "lower_bound_bytes": int(lower),
        "bytes_ratio": round(grad_bytes / lower, 4),
        "uniform_step_s": round(uniform, 5),
        "nonuniform_step_s": round(nonuniform, 5),
        "sync_wait_after_backward_s": sync_wait,
        "uniform_bytes_per_step": sum(r["sent"]["uniform"] for r in healthy) // steps,
        "busy_processes": {"uniform": 8, "nonuniform": 7},
        "bucket_bytes": BUCKET_BYTES,
        "setup": "gloo CPU, 8 procs, healthy replica TP4 vs job TP4+TP4 (DDP-equivalent) and TP4+TP3",
    }))


if __name__ == "__main__":
    main()
