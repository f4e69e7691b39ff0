"""Human-readable reasons: one line per change from the failure-free identity plan (pure)."""

from __future__ import annotations

from collections.abc import Mapping

from tpflex_proto.powermodel import PowerModel

from tpflex_controller.planner.model import (
    GpuKey,
    JobSpec,
    Policy,
    ReplicaAssignment,
    ReplicaState,
    full_tp,
)
from tpflex_controller.planner.stages import ReplicaDraft, StageDraft, describe_lost


def _health(s: StageDraft) -> str:
    return (
        f"rack {s.rack.name} has {len(s.usable)}/{len(s.spec_gpus)} usable GPUs "
        f"({describe_lost(s.lost)})"
    )


def _batch(a: ReplicaAssignment, job: JobSpec, memo: dict | None = None) -> str:
    key = ("batch", a.local_batch, job.local_batch, a.relative_throughput)
    out = memo.get(key) if memo is not None else None
    if out is None:
        out = f"local batch {a.local_batch}/{job.local_batch} ({a.relative_throughput:.3f}x throughput)"
        if memo is not None:
            memo[key] = out
    return out


def replica_reasons(
    d: ReplicaDraft,
    a: ReplicaAssignment,
    job: JobSpec,
    policy: Policy,
    caps: Mapping[GpuKey, float],
    speeds: Mapping[GpuKey, float],
    pins: Mapping[GpuKey, float],
    model: PowerModel,
) -> list[str]:
    head = f"replica {d.index}:"
    memo = getattr(model, "text", None)  # the plan's memo of formatted numbers (power.Curve)
    if a.state is ReplicaState.DROPPED:
        lost = [_health(s) for s in d.stages if s.lost]
        return [f"{head} {'; '.join(lost) + ' -> ' if lost else ''}dropped ({d.why})"]
    lines = [f"{head} {note}" for note in d.notes]
    full = full_tp(job)
    if d.pin is not None and d.pin < full:
        lines.append(f"{head} operator pin -> TP {d.pin}")
    if policy is Policy.NTP_PW and not d.fallback:
        lines += [_ntp_pw_line(head, s, job, model, memo) for s in d.stages if _changed(s, full)]
    elif a.tp_degree < full or d.lost_any:
        worst = min(d.stages, key=lambda s: len(s.usable))
        via = f"{d.fallback}: " if d.fallback else ""  # ntp-pw run as plain ntp (planner.py)
        lines.append(
            f"{head} {_health(worst)} -> {via}all {len(d.stages)} stage(s) at TP {a.tp_degree}, "
            f"{_batch(a, job)}"
        )
    lines += _slow_and_pinned(head, d, caps, speeds, pins)
    if a.relative_throughput < 1.0 - 1e-12 and policy is Policy.NTP_PW and not d.fallback:
        lines.append(f"{head} boost falls short -> {_batch(a, job, memo)}")
    return lines


def _changed(s: StageDraft, full: int) -> bool:
    """A stage that differs from its failure-free self (a lost GPU that an in-rack spare
    covers changes the GPUs it uses, not its degree)."""
    return s.degree < full or bool(s.lost) or s.cap_w is not None or s.needed_speed > 1.0


def _ntp_pw_line(head: str, s: StageDraft, job: JobSpec, model: PowerModel, memo: dict | None = None) -> str:
    key = ("ntp-pw", s.degree, s.cap_w, s.rack.tdp_w, s.needed_speed, s.no_headroom)
    tail = memo.get(key) if memo is not None else None
    if tail is None:
        tail = _ntp_pw_tail(s, model)
        if memo is not None:
            memo[key] = tail
    return f"{head} {_health(s)}{tail}"


def _ntp_pw_tail(s: StageDraft, model: PowerModel) -> str:
    what = f" -> TP {s.degree}"
    if s.cap_w is None:
        if s.needed_speed > 1.0:
            why = "GPU max limit = default" if s.no_headroom else "no power headroom"
            return f"{what}, not boosted ({why}), needs {s.needed_speed:.3f}x speed"
        return what
    ratio = s.cap_w / s.rack.tdp_w
    got = model.throughput(ratio)
    line = f"{what}, boosted to {ratio:.2f}x TDP ({s.cap_w:.0f} W) for {got:.3f}x speed"
    if got + 1e-9 < s.needed_speed:
        line += f" (needs {s.needed_speed:.3f}x)"
    return line


def _slow_and_pinned(
    head: str,
    d: ReplicaDraft,
    caps: Mapping[GpuKey, float],
    speeds: Mapping[GpuKey, float],
    pins: Mapping[GpuKey, float],
) -> list[str]:
    lines: list[str] = []
    if not speeds and not pins:
        return lines
    for s in d.stages:
        if not speeds and not pins.keys() & set(s.used):
            continue
        for g in s.used:
            if speeds.get(g, 1.0) < 1.0:
                lines.append(f"{head} GPU {g[0]}:{g[1]} on rack {s.rack.name} runs at {speeds[g]:.2f}x speed")
            if g in pins:
                lines.append(f"{head} GPU {g[0]}:{g[1]} on rack {s.rack.name} power pinned to {caps.get(g, s.rack.tdp_w):.0f} W")
    return lines
