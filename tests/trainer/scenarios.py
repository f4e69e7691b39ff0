"""Training scenarios run by every worker process of the parity tests.

A scenario is plain data (picklable): the model, the job's base TP, the initial plan and
plan changes at given steps (optionally killing a member first). Each worker trains with
``NtpRuntime`` and returns the global loss of every step it was active in.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tpflex_trainer.demo.data import global_batch  # noqa: F401  (the demo's data; re-exported)
from tpflex_trainer.ntp import collectives
from tpflex_trainer.ntp.config import GPTConfig
from tpflex_trainer.ntp.errors import UnitsUnavailableError
from tpflex_trainer.ntp.layout import Member, ReplicaPlacement
from tpflex_trainer.ntp.runtime import AdamSettings, NtpRuntime
from tpflex_trainer.ntp.torn import FAULT_ENV

from tests.trainer.harness import init_gloo

LR = 3e-3
SEED = 7


@dataclass(frozen=True)
class Change:
    step: int
    placements: tuple[ReplicaPlacement, ...]
    kill: Member | None = None  # this member's process exits before the change
    rejoin_port: int = 0  # survivors re-initialise the default group on this port
    checkpoint: str | None = None
    expect_unavailable: bool = False  # first try without the checkpoint: must be refused
    mid_step: bool = False  # the member dies when the step starts: survivors see it fail
    restart: Member | None = None  # this member loses its state (a fresh process in its place)
    stale: Member | None = None  # this member missed the last update (a torn step)
    # a torn step: ``kill`` exits and these members' last collective fails, both after the
    # step's last collective and before the optimizer update (the runtime's test hook); the
    # other members apply the update
    torn: tuple[Member, ...] = ()


@dataclass(frozen=True)
class Scenario:
    cfg: GPTConfig
    base_tp: int
    placements: tuple[ReplicaPlacement, ...]
    steps: int
    changes: tuple[Change, ...] = ()
    members: tuple[Member, ...] = ()  # process rank i plays members[i]
    save_at: int = -1  # save a checkpoint before this step
    checkpoint_dir: str = ""
    bucket_bytes: int = 32 * 1024
    start_checkpoint: str | None = None
    env: tuple[tuple[str, str], ...] = ()  # set in every worker before its runtime (test hooks)


def local_batch(rt: NtpRuntime, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    layout = rt.layout
    tokens, targets = global_batch(rt.cfg, step, layout.global_batch)
    offset = 0
    for rep in layout.replicas:
        if rep.replica == rt.me.replica:
            return tokens[offset : offset + rep.local_batch], targets[offset : offset + rep.local_batch]
        offset += rep.local_batch
    raise AssertionError("member's replica is not in the layout")


def _summary(report) -> dict:
    return {
        "source": report.source,
        "step": report.step,
        "units_moved": report.units_moved,
        "peer_units": report.peer_units,
        "bytes_moved": report.bytes_moved,
        "lower_bound_bytes": report.lower_bound_bytes,
        "bytes_sent": report.bytes_sent,
        "behind": [tuple(m) for m in report.behind],
    }


def _rejoin(me: Member, members: list[Member], dead: Member, port: int) -> list[Member]:
    """Survivors re-initialise the default group in-process without the dead member."""
    dist.destroy_process_group()
    survivors = [m for m in members if m != dead]
    init_gloo(survivors.index(me), len(survivors), port)
    return survivors


def _make_stale(rt: NtpRuntime) -> None:
    """Pretend the last optimizer update never happened here: older step, other weights."""
    rt.state.step -= 1
    for t in rt.state.tensors["param"].values():
        t.add_(0.01)


def _step_fails(rt: NtpRuntime, step: int) -> str:
    """Run the step a dead member takes part in: it must raise, not hang."""
    try:
        rt.train_step(*local_batch(rt, step))
    except RuntimeError as exc:  # gloo: connection closed/reset by the dead or leaving peer
        failure = type(exc).__name__
    else:
        failure = "completed"
    rt.abort()  # let peers still blocked in our groups fail now
    return failure


def _torn_step(rt: NtpRuntime, step: int) -> str:
    """Run the step a torn change tears (a member exits inside it); then abort."""
    try:
        rt.train_step(*local_batch(rt, step))
    except RuntimeError as exc:
        outcome = type(exc).__name__
    else:
        outcome = "updated"
    rt.abort()
    return outcome


def unit_states(rt: NtpRuntime) -> dict:
    """(kind, parameter, unit) -> that unit's rows, for every unit this member holds."""
    out = {}
    for spec in rt.specs:
        for pos, unit in enumerate(rt.state.units[spec.family]):
            rows = slice(pos * spec.unit_rows, (pos + 1) * spec.unit_rows)
            for kind, tensors in rt.state.tensors.items():
                out[(kind, spec.name, unit)] = tensors[spec.name][rows].numpy().copy()  # plain pickle
    return out


def _set_faults(sc: Scenario, me: Member) -> None:
    for change in sc.changes:
        if change.torn and me == change.kill:
            os.environ[FAULT_ENV] = f"{change.step}:exit"
        if me in change.torn:
            os.environ[FAULT_ENV] = f"{change.step}:fail"


def run_scenario(rank: int, world_size: int, sc: Scenario) -> dict:
    members = list(sc.members)
    me = members[rank]
    os.environ.update(dict(sc.env))
    _set_faults(sc, me)
    rt = NtpRuntime(sc.cfg, sc.base_tp, me, adam=AdamSettings(lr=LR), seed=SEED, bucket_bytes=sc.bucket_bytes)
    first = rt.start(sc.placements, {m: i for i, m in enumerate(members)}, sc.start_checkpoint)
    reports = [_summary(first)]
    changes = {c.step: c for c in sc.changes}
    losses: dict[int, float] = {}
    grad_norms: dict[int, float] = {}  # the global gradient norm of each step, as the runtime computed it
    step = first.step
    while step < sc.steps:
        if step == sc.save_at:
            rt.save_checkpoint(sc.checkpoint_dir)
        change = changes.pop(step, None)
        if change is not None:
            if change.torn:
                reports.append({"torn": _torn_step(rt, step)})
            if change.kill is not None:
                if me == change.kill:
                    collectives.flush_sends()  # the last step reached every peer before the death
                    os._exit(0)  # a GPU is gone: no goodbye to the peers
                if change.mid_step:
                    reports.append({"step_failed": _step_fails(rt, step)})
                members = _rejoin(me, members, change.kill, change.rejoin_port)
            if me == change.restart:
                rt.close()
                rt = NtpRuntime(sc.cfg, sc.base_tp, me, adam=AdamSettings(lr=LR), seed=SEED + 1,
                                bucket_bytes=sc.bucket_bytes)
            if me == change.stale:
                _make_stale(rt)
            world = {m: i for i, m in enumerate(members)}
            if change.expect_unavailable:
                try:
                    rt.apply_plan(change.placements, world)
                    raise AssertionError("a plan with unrecoverable units was accepted")
                except UnitsUnavailableError as exc:
                    reports.append({"refused": exc.code})
            report = rt.apply_plan(change.placements, world, change.checkpoint)
            reports.append(_summary(report))
            step = report.step
        if rt.active:
            tokens, targets = local_batch(rt, step)
            losses[step] = rt.train_step(tokens, targets)
            grad_norms[step] = rt.last_grad_norm
        step += 1
    overlap = (rt.sync.reduced_in_backward, len(rt.sync.buckets)) if rt.active else None
    grad_bytes = rt.sync.moved_bytes() if rt.active else None  # the last step's, counted at the send
    states = unit_states(rt) if rt.active else {}
    rt.close()
    return {"member": tuple(me), "losses": losses, "grad_norms": grad_norms, "reports": reports, "overlap": overlap,
            "grad_bytes": grad_bytes, "states": states, "step": step}
