"""The reconcile loop's one clock.

Two readings, as the loop needs both: ``wall()`` (seconds since the epoch) for what is
stored or shown (event and phase times, a plan's ``created_at``, a flap hold's ``until``
in etcd) and ``mono()`` (a monotonic clock) for deadlines (the work queue's retry
back-off and operator coalescing, the flap damper's hold-down, the agent pusher's
back-off). :class:`tpflex_controller.reconcile.Reconciler` takes one and reads time from
nothing else, so a test (or a simulator) drives all of it with one injected clock."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Clock:
    wall: Callable[[], float] = time.time
    mono: Callable[[], float] = time.monotonic


SYSTEM_CLOCK = Clock()
