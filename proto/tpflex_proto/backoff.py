"""The one retry pause of every reconnect loop: exponential, capped, with jitter.

Without jitter, 10,000 agents (or every controller thread) that lost etcd at the same
moment would retry in lockstep after the outage. Each pause is drawn uniformly from
[half, all] of the exponential step (AWS's "equal jitter"), so it stays within a factor
of two of the nominal schedule and never drops to zero.
"""

from __future__ import annotations

import random


class Backoff:
    def __init__(self, initial: float, maximum: float, *, rng: random.Random | None = None) -> None:
        if not 0 < initial <= maximum:
            raise ValueError("backoff needs 0 < initial <= maximum")
        self.initial = initial
        self.maximum = maximum
        self._rng = rng or random.Random()
        self._failures = 0

    def next(self) -> float:
        """The pause before the next attempt (seconds); each call doubles the step."""
        step = min(self.maximum, self.initial * 2 ** min(self._failures, 62))
        self._failures += 1
        return step * self._rng.uniform(0.5, 1.0)

    def reset(self) -> None:
        """After a success: the next failure starts from ``initial`` again."""
        self._failures = 0


def delay(attempt: int, initial: float, maximum: float, rng: random.Random | None = None) -> float:
    """The jittered pause before retry number ``attempt`` (1 = the first retry)."""
    step = min(maximum, initial * 2 ** min(max(attempt - 1, 0), 62))
    return step * (rng or random).uniform(0.5, 1.0)
