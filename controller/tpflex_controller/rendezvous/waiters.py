"""Parked Get/Wait calls: one etcd watch per job with waiting calls, fanned out to the
calls waiting for the keys that changed.

Protocol (no lost wake-up): a call registers its keys (which starts the job's watch at a
revision read before) and only then reads etcd; any put after that read has a later
revision and is delivered by the watch, which sets the call's event. A watch with no
registered calls for ``idle_close_s`` is closed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tpflex_proto import keys
from tpflex_proto.etcd import Etcd, Watch, WatchEvent

log = logging.getLogger(__name__)


@dataclass
class _JobWatch:
    watch: Watch | None = None
    waiting: dict[str, set[threading.Event]] = field(default_factory=dict)
    calls: int = 0
    idle_since: float = 0.0


class KeyWaiters:
    def __init__(self, etcd: Etcd, *, idle_close_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.etcd, self.idle_close_s, self._clock = etcd, idle_close_s, clock
        self._lock = threading.Lock()
        self._jobs: dict[str, _JobWatch] = {}

    def register(self, job: str, etcd_keys: Sequence[str]) -> threading.Event:
        """An event set whenever one of ``etcd_keys`` is written after this call."""
        event = threading.Event()
        with self._lock:
            jw = self._jobs.setdefault(job, _JobWatch())
            jw.calls += 1
            for k in etcd_keys:
                jw.waiting.setdefault(k, set()).add(event)
            if jw.watch is None:
                try:
                    jw.watch = self._open(job)
                except BaseException:
                    self._drop_locked(job, jw, etcd_keys, event)
                    raise
        return event

    def unregister(self, job: str, etcd_keys: Sequence[str], event: threading.Event) -> None:
        with self._lock:
            jw = self._jobs.get(job)
            if jw is not None:
                self._drop_locked(job, jw, etcd_keys, event)
            idle = self._idle_locked()
        for w in idle:
            w.cancel()

    def close(self) -> None:
        with self._lock:
            watches = [jw.watch for jw in self._jobs.values() if jw.watch is not None]
            self._jobs.clear()
        for w in watches:
            w.cancel()

    def watched_jobs(self) -> list[str]:
        with self._lock:
            return sorted(j for j, jw in self._jobs.items() if jw.watch is not None)

    # ---- internals ----

    def _open(self, job: str) -> Watch:
        prefix = keys.rendezvous_keys(job)
        _, rev = self.etcd.get_prefix(keys.rendezvous_lease(job), keys_only=True)
        return self.etcd.watch_prefix(prefix, lambda evs, j=job: self._deliver(j, evs),
                                      start_revision=rev + 1)

    def _deliver(self, job: str, events: list[WatchEvent]) -> None:
        with self._lock:
            jw = self._jobs.get(job)
            if jw is None:
                return
            woken = {e for ev in events if ev.kind == "put" for e in jw.waiting.get(ev.key, ())}
        for e in woken:
            e.set()

    def _drop_locked(self, job: str, jw: _JobWatch, etcd_keys: Sequence[str], event) -> None:
        jw.calls -= 1
        for k in etcd_keys:
            events = jw.waiting.get(k)
            if events is not None:
                events.discard(event)
                if not events:
                    del jw.waiting[k]
        if jw.calls == 0:
            jw.idle_since = self._clock()

    def _idle_locked(self) -> list[Watch]:
        now, out = self._clock(), []
        for job in [j for j, jw in self._jobs.items()
                    if jw.calls == 0 and now - jw.idle_since >= self.idle_close_s]:
            jw = self._jobs.pop(job)
            if jw.watch is not None:
                out.append(jw.watch)
        return out
