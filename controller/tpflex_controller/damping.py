"""Flap damping of GPU health: a hold-down before a recovered GPU may be planned again.

A failure always counts at once (the planner never uses a failed GPU). A recovery does
not: the GPU is *held* as failed until it has stayed healthy for the hold-down, and a GPU
that keeps failing is held longer, so a GPU that flaps costs one reconfiguration when it
first fails and one when it has been stable again, not two per flap.

Hold-down after a recovery: ``base * 2**(n - 1)`` seconds, capped at ``max_factor *
base``, where ``n`` is the number of failures of that GPU in the last ``memory_factor *
base`` seconds (defaults: 8x and 16x). A failure while held restarts the hold-down at
the next recovery. ``base == 0`` turns damping off.

Pure: no I/O and no clock of its own; every call takes ``now`` (seconds on any monotonic
clock). Lifecycle per GPU (transition table :data:`TRANSITIONS`):
``UP --fail--> DOWN --recover--> HELD --expire--> UP`` and ``HELD --fail--> DOWN``.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum


class Phase(Enum):
    UP = "up"  # healthy and plannable
    DOWN = "down"  # reported failed
    HELD = "held"  # reported healthy, still counted as failed until the hold-down ends


class Signal(Enum):
    FAIL = "fail"
    RECOVER = "recover"
    EXPIRE = "expire"


TRANSITIONS: dict[tuple[Phase, Signal], Phase] = {
    (Phase.UP, Signal.FAIL): Phase.DOWN,
    (Phase.UP, Signal.RECOVER): Phase.UP,
    (Phase.DOWN, Signal.FAIL): Phase.DOWN,
    (Phase.DOWN, Signal.RECOVER): Phase.HELD,
    (Phase.HELD, Signal.FAIL): Phase.DOWN,
    (Phase.HELD, Signal.RECOVER): Phase.HELD,
    (Phase.HELD, Signal.EXPIRE): Phase.UP,
}


class IllegalTransition(ValueError):
    """A signal that makes no sense in the GPU's phase (a bug in the caller)."""


def step(phase: Phase, signal: Signal) -> Phase:
    try:
        return TRANSITIONS[(phase, signal)]
    except KeyError:
        raise IllegalTransition(f"{signal.value} is not allowed in phase {phase.value}") from None


@dataclass
class _Track:
    phase: Phase = Phase.UP
    failures: deque[float] = field(default_factory=deque)  # start times of recent failures
    release_at: float = 0.0


@dataclass(frozen=True)
class Hold:
    """What a reader needs of a damped GPU: DOWN (failed, its hold-down not started) or
    HELD until ``release_at`` (the damper's clock). The leader stores one per damped GPU
    (``/tpflex/v1/holds/<node>/<index>``) so that the REST API and the next leader see it."""

    phase: Phase
    release_at: float = 0.0  # 0 while DOWN
    failures: int = field(default=0, compare=False)  # recent failures (informational)


class FlapDamper:
    def __init__(self, hold_down_s: float, *, max_factor: float = 8.0, memory_factor: float = 16.0) -> None:
        if hold_down_s < 0 or max_factor < 1 or memory_factor <= 0:
            raise ValueError("need hold_down_s >= 0, max_factor >= 1, memory_factor > 0")
        self.base = float(hold_down_s)
        self.max_hold = self.base * max_factor
        self.memory = self.base * memory_factor
        self._tracks: dict[Hashable, _Track] = {}
        self._releases: list[tuple[float, int, Hashable]] = []  # heap, lazily invalidated
        self._seq = 0

    # ---- queries ----

    def phase(self, gpu: Hashable) -> Phase:
        t = self._tracks.get(gpu)
        return t.phase if t is not None else Phase.UP

    def tracked(self) -> list[Hashable]:
        """GPUs the damper remembers (down, held, or with recent failures)."""
        return list(self._tracks)

    def hold_down(self, gpu: Hashable, now: float) -> float:
        """The hold-down a recovery of ``gpu`` at ``now`` would get."""
        t = self._tracks.get(gpu)
        n = len(self._recent(t, now)) if t is not None else 0
        return min(self.max_hold, self.base * 2 ** max(0, n - 1))

    def next_release(self) -> float | None:
        """When the earliest held GPU is due (``now`` units), or None."""
        while self._releases:
            at, _, gpu = self._releases[0]
            t = self._tracks.get(gpu)
            if t is not None and t.phase is Phase.HELD and t.release_at == at:
                return at
            heapq.heappop(self._releases)
        return None

    def holds(self, now: float) -> dict[Hashable, Hold]:
        """Every GPU the damper counts as failed (DOWN or HELD), bounded by those GPUs."""
        return {
            gpu: Hold(t.phase, t.release_at if t.phase is Phase.HELD else 0.0, len(self._recent(t, now)))
            for gpu, t in self._tracks.items() if t.phase is not Phase.UP
        }

    def adopt(self, holds: dict[Hashable, Hold], now: float) -> dict[Hashable, Hold]:
        """Take over stored holds (a new leader: the previous one's damping). A stored
        hold wins over what this damper has of that GPU; a GPU this damper holds that no
        stored hold names is released (the leader released it). DOWN tracks stay: the
        GPU's health drives them. Returns the holds as adopted (``holds()`` of them)."""
        if self.base == 0:
            return {}
        for gpu, t in self._tracks.items():
            if t.phase is Phase.HELD and gpu not in holds:
                t.phase = step(t.phase, Signal.EXPIRE)
        for gpu, h in holds.items():
            if h.phase is Phase.UP:
                continue
            t = self._tracks.setdefault(gpu, _Track())
            t.phase = h.phase
            recent = self._recent(t, now)
            while len(recent) < h.failures:  # their times are lost: remembered from now
                recent.append(now)
            if h.phase is Phase.HELD:
                t.release_at = h.release_at
                self._seq += 1
                heapq.heappush(self._releases, (t.release_at, self._seq, gpu))
        mine = self.holds(now)
        return {gpu: mine[gpu] for gpu in holds if gpu in mine}

    # ---- signals ----

    def observe(self, gpu: Hashable, failed: bool, now: float) -> bool:
        """Fold one health report; returns whether the GPU counts as failed."""
        if self.base == 0:
            return failed
        t = self._tracks.get(gpu)
        if t is None:
            if not failed:
                return False
            t = self._tracks[gpu] = _Track()
        before = t.phase
        t.phase = step(before, Signal.FAIL if failed else Signal.RECOVER)
        if failed and before is not Phase.DOWN:
            self._recent(t, now).append(now)
        elif t.phase is Phase.HELD and before is Phase.DOWN:
            t.release_at = now + self.hold_down(gpu, now)
            self._seq += 1
            heapq.heappush(self._releases, (t.release_at, self._seq, gpu))
        elif t.phase is Phase.UP and not self._recent(t, now):
            del self._tracks[gpu]  # nothing left to remember: bounded by recent flappers
        return t.phase is not Phase.UP

    def release_due(self, now: float) -> list[Hashable]:
        """Held GPUs whose hold-down has ended by ``now``: they are UP from here on."""
        out = []
        while (at := self.next_release()) is not None and at <= now:
            _, _, gpu = heapq.heappop(self._releases)
            t = self._tracks[gpu]
            t.phase = step(t.phase, Signal.EXPIRE)
            if not self._recent(t, now):
                del self._tracks[gpu]
            out.append(gpu)
        return out

    def _recent(self, t: _Track, now: float) -> deque[float]:
        while t.failures and t.failures[0] <= now - self.memory:
            t.failures.popleft()
        return t.failures
