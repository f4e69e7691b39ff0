"""The health loop: polls the backend, waits for XID/ECC events on a thread, folds both
through the pure ``health.assess`` and publishes ``NodeHealth`` snapshots to sinks
(the etcd writer, WatchHealth streams).

Publishing policy: a change of any GPU's state, reason or XIDs is *critical* and is
published at once; a change of routine readings only (power, temperature, clocks) is
published at most once per ``debounce_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tpflex_proto import types_pb2

from .backend import GpuBackend, GpuEvent
from .errors import GpuError
from .health import GpuHealthState, Observation, assess, to_proto

log = logging.getLogger(__name__)

Sink = Callable[[types_pb2.NodeHealth, bool], None]  # (snapshot, critical)


class HealthMonitor:
    def __init__(
        self, backend: GpuBackend, node: str, *, poll_interval_s: float = 0.5,
        debounce_s: float = 2.0, event_wait_s: float = 0.2,
        clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend, self.node = backend, node
        self.poll_interval_s, self.debounce_s, self.event_wait_s = poll_interval_s, debounce_s, event_wait_s
        self._clock, self._mono = clock, monotonic
        self._indices = [d.index for d in backend.devices()]
        self._gpus = {i: GpuHealthState(i) for i in self._indices}
        self.xid_counts = {i: 0 for i in self._indices}
        self._cond = threading.Condition()
        self._publish_lock = threading.Lock()
        self._sinks: list[Sink] = []
        self._seq = 0
        self._last = types_pb2.NodeHealth(node=node)
        self._last_publish = float("-inf")
        self._dirty = False
        self.events_handled = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ---- lifecycle ----

    def start(self) -> None:
        self.refresh(force=True)
        for name, target in (("health-poll", self._poll_loop), ("gpu-events", self._event_loop)):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        with self._cond:
            self._cond.notify_all()

    def add_sink(self, sink: Sink) -> None:
        with self._publish_lock:
            self._sinks.append(sink)

    def remove_sink(self, sink: Sink) -> None:
        with self._publish_lock:
            if sink in self._sinks:
                self._sinks.remove(sink)

    # ---- reads ----

    def snapshot(self) -> types_pb2.NodeHealth:
        with self._cond:
            out = types_pb2.NodeHealth()
            out.CopyFrom(self._last)
            return out

    def gpu_states(self) -> dict[int, GpuHealthState]:
        with self._cond:
            return dict(self._gpus)

    # ---- observation ----

    def _observe(self, index: int, events: tuple[GpuEvent, ...] = ()) -> Observation:
        try:
            return Observation(reading=self.backend.read(index), events=events)
        except GpuError as exc:
            return Observation(error=exc, events=events)

    def refresh(self, force: bool = False) -> types_pb2.NodeHealth:
        """Read every GPU now; publish per the policy (or always, with ``force``)."""
        observations = {i: self._observe(i) for i in self._indices}
        with self._cond:
            critical = self._fold(observations)
        self._maybe_publish(critical, force)
        return self.snapshot()

    def handle_events(self, events: list[GpuEvent]) -> None:
        by_gpu: dict[int, list[GpuEvent]] = {}
        for e in events:
            if e.index in self._gpus:
                by_gpu.setdefault(e.index, []).append(e)
            else:
                log.warning("gpu event for unknown index index=%d kind=%s", e.index, e.kind.value)
        observations = {i: self._observe(i, tuple(evs)) for i, evs in by_gpu.items()}
        with self._cond:
            for e in events:
                if e.xid and e.index in self.xid_counts:
                    self.xid_counts[e.index] += 1
                log.warning("gpu event node=%s gpu=%d kind=%s xid=%d", self.node, e.index, e.kind.value, e.xid)
            self._fold(observations)
            self.events_handled += len(events)
            self._cond.notify_all()
        self._maybe_publish(critical=True, force=True)

    def settle(self, events_emitted: int, timeout_s: float = 2.0) -> types_pb2.NodeHealth:
        """Wait until the event loop has handled ``events_emitted`` events, then refresh."""
        with self._cond:
            self._cond.wait_for(lambda: self.events_handled >= events_emitted, timeout_s)
        return self.refresh()

    def _fold(self, observations: dict[int, Observation]) -> bool:
        critical = False
        for i, obs in observations.items():
            prev = self._gpus[i]
            nxt = assess(prev, obs)
            if (nxt.state, nxt.reason, nxt.xids) != (prev.state, prev.reason, prev.xids):
                critical = True
                log.info("gpu health changed node=%s gpu=%d state=%s reason=%s", self.node, i,
                         types_pb2.GpuState.Name(nxt.state), nxt.reason)
            if nxt.reading != prev.reading:
                self._dirty = True
            self._gpus[i] = nxt
        return critical

    # ---- publishing ----

    def _maybe_publish(self, critical: bool, force: bool) -> None:
        with self._publish_lock:
            with self._cond:
                due = self._dirty and self._mono() - self._last_publish >= self.debounce_s
                if not (critical or force or due):
                    return
                self._seq += 1
                now = self._clock()
                msg = types_pb2.NodeHealth(node=self.node, updated_at=now, seq=self._seq)
                msg.gpus.extend(to_proto(self._gpus[i], now) for i in self._indices)
                self._last, self._dirty, self._last_publish = msg, False, self._mono()
                self._cond.notify_all()
            for sink in list(self._sinks):
                try:
                    sink(msg, critical)
                except Exception:  # one bad sink must not stop health reporting
                    log.exception("health sink failed node=%s", self.node)

    def wait_for_seq(self, seq: int, timeout_s: float) -> types_pb2.NodeHealth | None:
        with self._cond:
            ok = self._cond.wait_for(lambda: self._last.seq > seq or self._stop.is_set(), timeout_s)
            if not ok or self._stop.is_set():
                return None
            out = types_pb2.NodeHealth()
            out.CopyFrom(self._last)
            return out

    # ---- loops ----

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            try:
                self.refresh()
            except Exception:
                log.exception("health poll failed node=%s", self.node)

    def _event_loop(self) -> None:
        while not self._stop.is_set():
            try:
                events = self.backend.wait_events(self.event_wait_s)
            except GpuError as exc:
                log.error("gpu event wait failed node=%s error=%s", self.node, exc)
                self._stop.wait(1.0)
                continue
            if events:
                self.handle_events(events)
