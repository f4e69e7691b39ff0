"""The chaos soak's independent oracle: every plan generation's first steps against the
single-process reference.

The same-layout replay (``bench/soak_replay.py``) drives the same ``NtpRuntime`` through the
chaos run's plans: it shows that faults reduce to fault-free arithmetic, not that the
arithmetic is right. Here the ranks (``TPFLEX_DEMO_DUMP_DIR``, ``demo/dumps.py``) dump the
whole job state (weights and Adam moments, every unit, per replica) that the first round
of each generation started from (``entry``), and the state ``DUMP_STEPS`` steps later
(``exit``). The oracle loads an entry dump into the dense single-process model of
``ntp/reference.py`` (plain tensors, ``torch.optim.Adam`` at the dump's step, in float64), trains it on
each step's whole global batch (``global_batch(step, samples)``, the samples the replicas
split between them: the loss is the global-batch mean, so a degraded replica's share
weighs by its samples), and compares the losses every rank recorded for those steps and
every replica's exit dump (weights and both moments) with it: relative L2, at most
``TOLERANCE``. Replicas' entry dumps must agree too. No NtpRuntime code runs here.

A generation whose layout (per-replica degrees, global batch) differs from the previous
one's is a layout change (an XID 79, a drain, a repair); each must have a complete
window (some replica's entry and exit dumps). Pure parts: :func:`layout_changes`,
:func:`window_losses`.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

TOLERANCE = 1e-5
WINDOW = re.compile(r"g(\d+)-e(\d+)-s(\d+)$")


@dataclass
class Check:
    generation: int
    epoch: int
    start: int
    checked: bool
    rel_l2: float = 0.0  # the largest of the comparisons below
    details: dict = field(default_factory=dict)
    why: str = ""  # when not checked


def layout_changes(records: list[dict]) -> list[int]:
    """The generations (in the order the job first trained in them) whose layout (per-replica
    degrees, global batch, from the step records) differs from the generation trained in
    before. The first generation is no change. Pure."""
    first: dict[int, tuple[float, str]] = {}
    for r in records:
        if r["kind"] == "step":
            sig = json.dumps([r["degrees"], r["global_batch"]])
            if r["generation"] not in first or r["t"] < first[r["generation"]][0]:
                first[r["generation"]] = (r["t"], sig)
    order = sorted(first, key=lambda g: first[g][0])
    return [g for prev, g in zip(order, order[1:], strict=False) if first[g][1] != first[prev][1]]


def window_losses(records: list[dict], generation: int, pids: set[int], start: int, steps: int) -> dict[int, list[float]]:
    """Per step of the window, the losses its dumping processes recorded in that generation. Pure."""
    out: dict[int, list[float]] = {}
    for r in records:
        if (r["kind"] == "step" and r["generation"] == generation and r["pid"] in pids
                and start <= r["step"] < start + steps):
            out.setdefault(r["step"], []).append(r["loss"])
    return out


def _complete(path: Path, adapter) -> tuple[int, dict, list[dict]] | None:
    """A replica's dump as (step, full state, sidecars), or None when a member's part is
    missing (a member died before writing it, or was not in the round)."""
    from tpflex_trainer.ntp.checkpoint import read_full_state, write_meta
    from tpflex_trainer.ntp.errors import CheckpointError

    sides = [json.loads(p.read_text()) for p in sorted(path.glob("*.pt.json"))]
    if not sides:
        return None
    replica = path.name[1:]
    if len(sides) != sides[0]["degrees"][replica] or len({s["step"] for s in sides}) != 1:
        return None
    write_meta(path, adapter.fingerprint(), sides[0]["step"], [s["file"] for s in sides])
    try:
        step, state = read_full_state(path, adapter)
    except CheckpointError:
        return None
    return step, state, sides


def window_dumped(dump_dir: Path, generation: int) -> bool:
    """Whether some replica's exit dump of a window of ``generation`` is complete (every
    member's sidecar is written, atomically): the oracle can check that generation. The
    soak waits for it before its next fault, and before it repairs an XID's GPU."""
    for path in dump_dir.glob(f"g{generation:06d}-e*-s*/exit/r*"):
        sides = [json.loads(p.read_text()) for p in path.glob("*.pt.json")]
        if sides and len(sides) == sides[0]["degrees"].get(path.name[1:]):
            return True
    return False


def reference_from(cfg, state: dict, step: int, batches, lr: float, betas, eps: float,
                   dtype: torch.dtype = torch.float64):
    """The dense reference (``ntp/reference.py``'s model, ``torch.optim.Adam``) continued from
    a full state at Adam step ``step``: (losses, final state in float32).

    It computes in ``dtype``, float64 by default: the job's first window starts at Adam step
    0, where the update divides each element's gradient by its own magnitude (v-hat = g^2),
    and float32 rounding in small-gradient elements grows to ~1e-5 within 3 steps. In the
    10-minute soak's first window a float32 reference was 3.1e-5 (exp_avg) from the float64
    one, the chaos run 4.3e-6: the float32 reference, not the job, missed. Later windows
    (Adam's v over many steps) agree within 1e-6 either way."""
    from tpflex_trainer.ntp.reference import reference_loss

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # what the reference model creates (positions, masks)
    try:
        params = {n: t.detach().to(dtype).clone().requires_grad_(True) for n, t in state["param"].items()}
        opt = torch.optim.Adam(params.values(), lr=lr, betas=betas, eps=eps, foreach=False)
        for n, p in params.items():
            opt.state[p] = {"step": torch.tensor(float(step)), "exp_avg": state["exp_avg"][n].to(dtype).clone(),
                            "exp_avg_sq": state["exp_avg_sq"][n].to(dtype).clone()}
        losses = []
        for tokens, targets in batches:
            opt.zero_grad(set_to_none=True)
            loss = reference_loss(cfg, params, tokens, targets)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        torch.set_default_dtype(default)
    out = {"param": {n: p.detach().float() for n, p in params.items()}}
    for kind in ("exp_avg", "exp_avg_sq"):
        out[kind] = {n: opt.state[p][kind].detach().float() for n, p in params.items()}
    return losses, out


def warm_up() -> None:
    """The first ``torch.optim.Adam`` of a process imports ``torch._dynamo`` (seconds of
    CPU): the soak does it in a thread while its chaos run waits for the ranks."""
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])


def _rel_l2(a: list[float], b: list[float]) -> float:
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b, strict=True)) / max(sum(y * y for y in b), 1e-300))


def check_window(path: Path, records: list[dict], cfg, adapter, adam, steps: int) -> Check:
    from tpflex_trainer.demo.data import global_batch
    from tpflex_trainer.ntp.reference import state_rel_l2
    from tpflex_trainer.ntp.state import KINDS

    g, e, s = (int(x) for x in WINDOW.match(path.name).groups())
    entries = {p.name: d for p in sorted((path / "entry").glob("r*")) if (d := _complete(p, adapter))}
    exits = {p.name: d for p in sorted((path / "exit").glob("r*")) if (d := _complete(p, adapter))}
    if not entries or not exits:
        return Check(g, e, s, False, why=f"complete dumps: entry {sorted(entries)} exit {sorted(exits)}")
    details: dict = {}
    step0, start, sides0 = next(iter(entries.values()))
    if step0 != s:
        raise RuntimeError(f"{path.name}: the entry dump is at step {step0}")
    for name, (_, st, _) in list(entries.items())[1:]:  # the replicas started from the same state
        details[f"entry {name} vs {next(iter(entries))}"] = max(state_rel_l2(st[k], start[k]) for k in KINDS)
    batch = sides0[0]["global_batch"]
    if any(sum(d[2][0]["local_batches"].values()) != batch for d in [*entries.values(), *exits.values()]):
        raise RuntimeError(f"{path.name}: the replicas' local batches do not add up to the global batch {batch}")
    n = steps
    pids = {side["pid"] for d in [*entries.values(), *exits.values()] for side in d[2]}
    recorded = window_losses(records, g, pids, s, n)
    for step in range(s, s + n):
        gb = {r["global_batch"] for r in records if r["kind"] == "step" and r["generation"] == g and r["step"] == step
              and r["pid"] in pids}
        if gb != {batch}:
            raise RuntimeError(f"{path.name}: step {step} recorded global batches {sorted(gb)}, the layout's {batch}")
    if sorted(recorded) != list(range(s, s + n)):
        return Check(g, e, s, False, why=f"losses recorded for steps {sorted(recorded)}")
    losses, ref = reference_from(cfg, start, s, [global_batch(cfg, k, batch) for k in range(s, s + n)],
                                 adam.lr, adam.betas, adam.eps)
    for i in range(max(len(v) for v in recorded.values())):
        got = [recorded[k][min(i, len(recorded[k]) - 1)] for k in range(s, s + n)]
        details[f"losses {i}"] = _rel_l2(got, losses)
    for name, (step1, st, _) in exits.items():
        if step1 != s + n:
            raise RuntimeError(f"{path.name}: the exit dump of {name} is at step {step1}, not {s + n}")
        for k in KINDS:
            details[f"exit {name} {k}"] = state_rel_l2(st[k], ref[k])
    details["reference losses"] = losses
    worst = max(v for k, v in details.items() if k != "reference losses")
    return Check(g, e, s, True, worst, details)


def run_oracle(dump_dir: Path, records: list[dict], cfg, adapter, adam, steps: int, keep: bool = False) -> list[Check]:
    """Every window dumped under ``dump_dir``, oldest first (removed once checked unless
    ``keep``). One torch thread: a tiny model, on cores the soak's processes share."""
    out, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        windows = [p for p in dump_dir.iterdir() if WINDOW.match(p.name)] if dump_dir.exists() else []
        for path in sorted(windows, key=lambda p: tuple(int(x) for x in WINDOW.match(p.name).groups())):
            out.append(check_window(path, records, cfg, adapter, adam, steps))
            if not keep:
                shutil.rmtree(path, ignore_errors=True)
    finally:
        torch.set_num_threads(threads)
    return out


def summary(checks: list[Check], changes: list[int]) -> tuple[int, float | None, list[str]]:
    """(layout changes checked, the largest relative L2 of any checked window, misses: a
    checked window beyond ``TOLERANCE`` or a layout change no window checked). Pure."""
    checked = {c.generation for c in checks if c.checked}
    misses = [f"generation {c.generation} (epoch {c.epoch}, steps {c.start}..): rel L2 {c.rel_l2:.3g} > "
              f"{TOLERANCE:g}: {c.details}" for c in checks if c.checked and not c.rel_l2 <= TOLERANCE]
    misses += [f"layout change to generation {g} not checked: "
               f"{[c.why for c in checks if c.generation == g] or 'no dump'}" for g in changes if g not in checked]
    worst = max((c.rel_l2 for c in checks if c.checked), default=None)
    return sum(1 for g in changes if g in checked), worst, misses
