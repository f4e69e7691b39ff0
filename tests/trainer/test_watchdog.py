"""The collective watchdog (a fake clock) and ``abort_groups``'s tolerance of groups that
are already gone (the NCCL abort itself: test_gpu_liveness.py)."""

from __future__ import annotations

import threading

import pytest
from tpflex_trainer.hooks.config import HooksConfig
from tpflex_trainer.hooks.watchdog import Watchdog, abort_groups


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_fires_once_per_stuck_section_and_reports_how_long():
    clock, hangs = Clock(), []
    dog = Watchdog(5.0, hangs.append, clock=clock)
    assert dog.check() is False  # nothing guarded
    with dog.guard():
        clock.now = 5.0
        assert dog.check() is False and dog.hung_s() == 0.0
        clock.now = 6.0
        assert dog.check() is True and hangs == [6.0]
        clock.now = 9.0
        assert dog.check() is False and dog.hung_s() == 9.0  # once per section; beats carry it
    assert dog.hung_s() == 0.0
    with dog.guard():  # a new section starts its own count
        clock.now = 13.0
        assert dog.check() is False
        clock.now = 14.5
        assert dog.check() is True and dog.fired == 2


def test_its_thread_fires_on_its_own():
    fired = threading.Event()
    dog = Watchdog(0.05, lambda s: fired.set())
    dog.start()
    try:
        with dog.guard():
            assert fired.wait(5.0)
    finally:
        dog.stop()


def test_the_limit_is_always_below_the_collective_timeout():
    base = dict(controller=("c:1",), job="j", node="n", gpu=0, store="tpflex://", spec_file="s")
    assert HooksConfig(**base, collective_timeout_s=60.0).watchdog_after_s == 30.0
    assert HooksConfig(**base, collective_timeout_s=60.0, watchdog_s=10.0).watchdog_after_s == 10.0
    assert HooksConfig(**base, collective_timeout_s=60.0, watchdog_s=600.0).watchdog_after_s == 30.0
    with pytest.raises(ValueError):
        Watchdog(0.0, lambda s: None)


def test_abort_groups_counts_what_it_aborted_and_survives_broken_ones():
    class Group:
        def __init__(self, ok: bool) -> None:
            self.ok, self.aborted = ok, False

        def abort(self) -> None:
            if not self.ok:
                raise RuntimeError("already destroyed")
            self.aborted = True

    good, bad = Group(True), Group(False)
    assert abort_groups([good, None, bad], "test") == 1 and good.aborted
