"""Validation and resolution of power plans (pure: no I/O).

A plan is level-triggered: it states the wanted limit (and locked SM clock) of *every*
GPU of the node; a GPU the plan does not list goes back to its default limit with
unlocked clocks. Validation is all-or-nothing: one bad value rejects the whole plan
before any device is touched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .backend import ClockTarget, DeviceInfo
from .errors import AgentError, AgentErrorCode

LIMIT_TOLERANCE_W = 1e-6


@dataclass(frozen=True, slots=True)
class CapRequest:
    node: str
    index: int
    cap_w: float
    locked_sm_clock_mhz: int = 0


@dataclass(frozen=True)
class AppliedPlan:
    generation: int
    targets: Mapping[int, ClockTarget]
    complete: bool  # every GPU reached its target


@dataclass(frozen=True)
class Resolution:
    generation: int
    targets: dict[int, ClockTarget]
    already_applied: bool
    regression: bool = False  # desired state older than the applied one (etcd went back)


def _invalid(msg: str) -> AgentError:
    return AgentError(AgentErrorCode.INVALID_ARGUMENT, msg)


def described(dev: DeviceInfo) -> bool:
    """False for a GPU that was lost when the agent started: its limits are unknown (the
    NVML backend describes it with a zero range)."""
    return dev.max_limit_w > 0


def _check_cap(cap: CapRequest, node: str, dev: DeviceInfo | None, indices: str) -> None:
    if cap.node and cap.node != node:
        raise _invalid(f"cap for gpu {cap.node}/{cap.index} sent to node {node}")
    if dev is None:
        raise _invalid(f"unknown GPU index {cap.index} (node {node} has {indices})")
    if not math.isfinite(cap.cap_w):
        raise _invalid(f"gpu {cap.index}: cap {cap.cap_w!r} W is not a finite number")
    if not described(dev):
        if cap.cap_w < 0 or cap.locked_sm_clock_mhz < 0:
            raise _invalid(f"gpu {cap.index}: cap {cap.cap_w!r} W / locked SM clock "
                           f"{cap.locked_sm_clock_mhz} MHz is negative")
        return  # its range is unknown: the write says whether the device takes it
    if not dev.min_limit_w - LIMIT_TOLERANCE_W <= cap.cap_w <= dev.max_limit_w + LIMIT_TOLERANCE_W:
        raise _invalid(
            f"gpu {cap.index}: cap {cap.cap_w!r} W outside the device's range "
            f"[{dev.min_limit_w:g}, {dev.max_limit_w:g}] W"
        )
    if cap.locked_sm_clock_mhz < 0 or cap.locked_sm_clock_mhz > dev.max_sm_clock_mhz:
        raise _invalid(
            f"gpu {cap.index}: locked SM clock {cap.locked_sm_clock_mhz} MHz outside "
            f"[0, {dev.max_sm_clock_mhz}] MHz (0 = unlocked)"
        )


def resolve_plan(
    node: str, generation: int, caps: Sequence[CapRequest], devices: Sequence[DeviceInfo],
    current: AppliedPlan | None, *, authoritative: bool = False,
) -> Resolution:
    """The per-GPU targets of a plan, or :class:`AgentError` if it must be refused.

    ``authoritative``: the plan is etcd's desired state, which wins over what was applied:
    an older generation (etcd restored from a snapshot, or a forged newer one applied
    before) is applied and flagged as a regression, and generation 0 means "no desired
    caps" (the key was deleted): every GPU at its default, which is no regression."""
    if generation < (0 if authoritative else 1):
        raise _invalid("generation must be >= 1")
    stale = current is not None and generation < current.generation
    if stale and not authoritative:
        raise AgentError(
            AgentErrorCode.STALE_GENERATION,
            f"stale generation {generation}: generation {current.generation} is already applied",
        )
    targets = plan_targets(node, caps, devices)
    if current is not None and generation == current.generation:
        if dict(current.targets) == targets:
            return Resolution(generation, targets, already_applied=current.complete)
        if not authoritative:
            raise AgentError(
                AgentErrorCode.GENERATION_CONFLICT,
                f"generation {generation} was already applied with different caps",
            )
    return Resolution(generation, targets, already_applied=False, regression=stale and generation > 0)


def plan_targets(node: str, caps: Sequence[CapRequest], devices: Sequence[DeviceInfo]) -> dict[int, ClockTarget]:
    """Every GPU's target under ``caps`` (validated all-or-nothing; unlisted GPUs at their
    default limit, clocks unlocked; an unlisted GPU lost since start-up, whose default is
    unknown, has no target)."""
    by_index = {d.index: d for d in devices}
    indices = f"indices 0..{len(devices) - 1}" if devices else "no GPUs"
    seen: set[int] = set()
    for cap in caps:
        _check_cap(cap, node, by_index.get(cap.index), indices)
        if cap.index in seen:
            raise _invalid(f"gpu {cap.index} appears twice in the plan")
        seen.add(cap.index)
    targets = {d.index: ClockTarget(d.default_limit_w, 0) for d in devices if described(d)}
    targets.update({c.index: ClockTarget(float(c.cap_w), int(c.locked_sm_clock_mhz)) for c in caps})
    return targets


def divergent(targets: Mapping[int, ClockTarget], limits: Mapping[int, float], tolerance_w: float = 1.0) -> list[int]:
    """GPUs whose enforced limit is away from its target (NVML rounds to milliwatts)."""
    return sorted(i for i, t in targets.items() if i in limits and abs(limits[i] - t.cap_w) > tolerance_w)


def apply_order(targets: Mapping[int, ClockTarget], current_limits: Mapping[int, float]) -> list[int]:
    """GPUs whose limit goes down first, then the rest, so that a rack's total power never
    rises above both the old and the new plan's total while a plan is being applied."""
    def rises(i: int) -> bool:
        return targets[i].cap_w > current_limits.get(i, float("inf"))

    return sorted(targets, key=lambda i: (rises(i), i))
