"""The reconcile loop reads time from its one injected clock (tpflex_controller.clock):
a real etcd and an in-process controller whose clock a test sets."""

from __future__ import annotations

import threading

from tpflex_controller.clock import Clock
from tpflex_proto import codec, keys, types_pb2

from tests.controller.controller_harness import controller_on_job, fail_gpu
from tests.support.wait import wait_until

WALL_BASE = 4_000_000_000.0  # 2096: no real clock reads this
HOLD_DOWN_S = 3600.0


class ManualClock:
    """Time that moves only when the test says so."""

    def __init__(self) -> None:
        self._t = 0.0
        self._lock = threading.Lock()
        self.clock = Clock(wall=lambda: WALL_BASE + self.now(), mono=self.now)

    def now(self) -> float:
        with self._lock:
            return self._t

    def advance(self, s: float) -> None:
        with self._lock:
            self._t += s


def _hold(etcd, key):
    kv = etcd.get(key)
    return codec.decode(types_pb2.GpuHold, kv.value) if kv is not None else None


def test_an_hour_of_flap_hold_down_passes_when_the_injected_clock_says_so(etcd_server, etcd):
    """Every time the loop stores or waits on comes from the clock: the plans' and
    events' times are its wall time, the stored hold ends an hour of its time later, and
    the held GPU is planned again once the clock (not the machine) has moved an hour."""
    t = ManualClock()
    gpu = ("rack0-n00", 1)
    with controller_on_job(etcd_server, etcd, flap_hold_down_s=HOLD_DOWN_S, clock=t.clock) as (_r, watcher, _c):
        first = watcher.wait_generation(1, timeout=20)
        assert first.created_at == WALL_BASE
        t.advance(10.0)
        fail_gpu(etcd, gpu[0], 2, {gpu[1]}, seq=1)
        failed = watcher.wait_generation(2, timeout=20)
        assert failed.created_at == WALL_BASE + 10.0
        t.advance(5.0)
        fail_gpu(etcd, gpu[0], 2, set(), seq=2)  # recovered: held for the hold-down
        rec = wait_until(lambda: (h := _hold(etcd, keys.gpu_hold(*gpu))) and h.until > 0 and h,
                         20, "the stored hold")
        assert rec.until == WALL_BASE + 15.0 + HOLD_DOWN_S
        assert watcher.latest().generation == 2
        t.advance(HOLD_DOWN_S)
        back = watcher.wait_generation(3, timeout=20)  # the loop wakes at least once a second
        assert gpu in {(g.node, g.index) for r in back.replicas for st in r.stages for g in st.gpus}
        assert back.created_at == WALL_BASE + 15.0 + HOLD_DOWN_S
        wait_until(lambda: _hold(etcd, keys.gpu_hold(*gpu)) is None, 20, "the hold deleted")
        events = [codec.decode(types_pb2.Event, kv.value) for kv in etcd.get_prefix(keys.EVENTS)[0]]
        committed = sorted(e.at for e in events if e.kind == "plan_committed")
        assert committed == [WALL_BASE, WALL_BASE + 10.0, WALL_BASE + 15.0 + HOLD_DOWN_S], committed
