"""Failure traces (pure, seeded): when which GPUs fail and when they come back.

Failures form a Poisson process of rate ``rate * scale`` per working GPU-hour. Arrivals
are drawn at rate ``rate * scale * N`` on a uniformly chosen GPU and ignored when that GPU
is already down (thinning: the accepted rate is exactly per working GPU). A failure's
blast radius takes down the GPU, its node or its whole domain (GPUs of the radius that
are already down keep their own repair). A failure is hardware with probability
``hw_fraction`` (repaired after a uniform 3-5 days by default) or software (3 hours).
Every GPU a failure takes down comes back together at its repair time.

A trace does not depend on the policy, so policies are compared on the same failures.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from tpflex_controller.sim.config import Blast, FailureConfig


@dataclass(frozen=True, slots=True)
class TraceEvent:
    time_h: float
    failed: bool  # True: the GPUs go down; False: they are repaired
    gpus: tuple[int, ...]
    hardware: bool


def failure_trace(
    cfg: FailureConfig,
    gpus: int,
    hours: float,
    rng: random.Random,
    radius: Callable[[int, Blast], range],
    start_h: float = 0.0,
) -> list[TraceEvent]:
    """Events in time order on [start_h, hours)."""
    rate = cfg.rate_per_gpu_hour * cfg.rate_scale * gpus
    down: set[int] = set()
    repairs: list[tuple[float, int, tuple[int, ...], bool]] = []
    events: list[TraceEvent] = []
    t = start_h
    seq = 0
    while rate > 0:
        t += rng.expovariate(rate)
        while repairs and repairs[0][0] <= min(t, hours):
            when, _, group, hw = heapq.heappop(repairs)
            down.difference_update(group)
            events.append(TraceEvent(when, False, group, hw))
        if t >= hours:
            break
        target = rng.randrange(gpus)
        if target in down:
            continue
        group = tuple(g for g in radius(target, cfg.blast) if g not in down)
        hw = rng.random() < cfg.hw_fraction
        down.update(group)
        events.append(TraceEvent(t, True, group, hw))
        heapq.heappush(repairs, (t + _repair_hours(cfg, hw, rng), seq, group, hw))
        seq += 1
    return events


def _repair_hours(cfg: FailureConfig, hardware: bool, rng: random.Random) -> float:
    if not hardware:
        return cfg.sw_repair_hours
    lo, hi = cfg.hw_repair_days
    return 24.0 * (lo if hi == lo else rng.uniform(lo, hi))


def sample_failed(gpus: int, fraction: float, rng: random.Random) -> list[int]:
    """Each GPU failed independently with probability ``fraction`` (geometric skips:
    O(failed) draws, not O(GPUs))."""
    if fraction <= 0:
        return []
    if fraction >= 1:
        return list(range(gpus))
    log_q = math.log1p(-fraction)
    out = []
    g = -1
    while True:
        skip = math.log(1.0 - rng.random()) / log_q  # inf when log_q underflows to ~0
        if g + 1 + skip >= gpus:
            return out
        g += 1 + int(skip)
        out.append(g)
