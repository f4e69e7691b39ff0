"""Resharding cost: a GPT-like model's replica goes from TP ``from_tp`` to ``to_tp``
(planned drain of the last slots; the departing members send their units, survivors keep
theirs). Bytes moved are counted at the send (the P2P buffers of every member) and compared
with a bound from the change and the config's shapes: every unit the departing members
held (read from their state) must leave them, at a unit's payload size computed here from
``CFG`` (weights and two Adam moments, fp32). ``planned_bytes`` is the reshard plan's own
figure. ``reshard_s`` is the data movement of the reshard (batched P2P of the units +
assembling the new local state, slowest rank), ``full_reload_s`` the same for a naive
full reload (broadcast of the whole model + Adam state to every member, then slicing),
measured in the same processes;
``apply_plan_s`` is the whole reconfiguration (agreement, new process groups, transfer,
rebuild) with its phases. gloo on CPU, one process per rank, all on this machine's cores.

Prints one JSON line. Run: PYTHONPATH=. .venv/bin/python bench/reshard.py
(``--quick``: the one case 4 -> 3, the same keys, seconds; for the test suite).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tpflex_trainer.ntp.config import REPLICATED, GPTConfig
from tpflex_trainer.ntp.layout import Member, ReplicaPlacement

from tests.trainer.harness import run_workers
from tests.trainer.test_parity import unit_bytes

# GPT-like: 72 heads (MHA, head_dim 4), FFN 4x hidden, every family has >= 72 units
CFG = GPTConfig(n_layers=2, hidden=288, n_heads=72, n_kv_groups=72, ffn_hidden=1152, ffn_block=8,
                vocab=2304, vocab_block=16, seq_len=128)
CASES = ((8, 7), (32, 28), (72, 71))
QUICK_CASES = ((4, 3),)


def _max_over_ranks(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _full_reload(rt) -> float:
    """Rank 0 broadcasts the whole state (every unit's payload); each member slices its own."""
    import torch
    import torch.distributed as dist
    from tpflex_trainer.ntp.state import build_state, payload_numel

    units = {f: n for f, n in CFG.unit_counts().items()}
    sizes = [(f, u, payload_numel(rt.specs, f)) for f, n in [*units.items(), ("_replicated", 1)] for u in range(n)]
    full = torch.zeros(sum(n for _, _, n in sizes))
    offsets, off = {}, 0
    for f, u, n in sizes:
        offsets[(f, u)] = (off, n)
        off += n
    dist.barrier()
    t0 = time.perf_counter()
    dist.broadcast(full, src=0)
    build_state(rt.specs, rt.state.units, rt.step, full.device,
                lambda f, u: full[offsets[(f, u)][0] : sum(offsets[(f, u)])])
    return _max_over_ranks(time.perf_counter() - t0)


def _worker(rank: int, world_size: int, from_tp: int, to_tp: int) -> dict:
    import torch.distributed as dist
    from tpflex_trainer.ntp.runtime import NtpRuntime

    members = [Member(0, s) for s in range(from_tp)]
    world = {m: i for i, m in enumerate(members)}
    rt = NtpRuntime(CFG, from_tp, members[rank], seed=0)
    rt.start((ReplicaPlacement(0, tuple(range(from_tp))),), world)
    shapes = unit_bytes(CFG)
    held = {f: len(u) for f, u in rt.state.units.items() if f != REPLICATED}  # survivors hold those
    departing = sum(shapes[f] * n for f, n in held.items()) if rank >= to_tp else 0
    reload_s = _full_reload(rt)
    dist.barrier()
    report = rt.apply_plan((ReplicaPlacement(0, tuple(range(to_tp))),), world)
    apply_s = _max_over_ranks(report.seconds)
    phases = {k: round(_max_over_ranks(v), 4) for k, v in sorted(report.phases.items())}
    rt.close()
    return {"sent": report.bytes_sent, "planned": report.bytes_moved, "departing": departing,
            "apply_s": apply_s, "phases": phases, "reload_s": reload_s}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the one case 4 -> 3 (the same JSON keys)")
    cases = []
    for from_tp, to_tp in QUICK_CASES if ap.parse_args(argv).quick else CASES:
        t0 = time.perf_counter()
        res = list(run_workers(_worker, from_tp, (from_tp, to_tp), timeout_s=300).values())
        print(f"case {from_tp}->{to_tp} took {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        cases.append({
            "from_tp": from_tp,
            "to_tp": to_tp,
            "bytes_moved": sum(r["sent"] for r in res),
            "lower_bound_bytes": sum(r["departing"] for r in res),
            "planned_bytes": res[0]["planned"],
            "reshard_s": res[0]["phases"]["transfer_s"],
            "full_reload_s": round(res[0]["reload_s"], 4),
            "apply_plan_s": round(res[0]["apply_s"], 4),
            "apply_plan_phases_s": res[0]["phases"],
        })
    ratio = max(c["bytes_moved"] / c["lower_bound_bytes"] for c in cases)
    print(json.dumps({"cases": cases, "max_bytes_ratio": round(ratio, 4)}))


if __name__ == "__main__":
    main()
