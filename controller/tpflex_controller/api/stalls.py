"""A debugging aid for REST latency stalls, off unless ``TPFLEX_DEBUG_REST_STALLS`` names
a file (a debug switch, not a setting): the REST process then appends one JSON line per
notable thing to that file.

- ``gc``: a cyclic collection that took >= 5 ms (generation, ms, objects collected);
- ``lag``: the event loop ran a 10 ms timer late by >= 20 ms;
- ``stuck``: the loop thread had not ticked for >= 150 ms: the stacks of every thread at
  that moment (who holds the loop, and what the others are doing);
- ``slow``: a request that took >= 50 ms inside the server (path, ms, the time it waited
  before the app first ran is not separable here: it is the whole ASGI call);
- ``fold``: an informer batch folded into the API's tables in >= 5 ms (changes, ms).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import threading
import time
import traceback

ENV = "TPFLEX_DEBUG_REST_STALLS"


class StallLog:
    def __init__(self, path: str) -> None:
        self._f = open(path, "a", buffering=1)  # noqa: SIM115 (closed with the process)
        self._lock = threading.Lock()
        self._gc_t0 = 0.0
        self.tick = time.monotonic()
        self.loop_thread: int | None = None
        self._stop = threading.Event()

    def write(self, kind: str, **fields) -> None:
        line = json.dumps({"t": round(time.time(), 3), "kind": kind, **fields})
        with self._lock:
            self._f.write(line + "\n")

    # ---- gc ----

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
            return
        ms = (time.perf_counter() - self._gc_t0) * 1000
        if ms >= 5:
            self.write("gc", gen=info["generation"], ms=round(ms, 1), collected=info["collected"],
                       objects=len(gc.get_objects(info["generation"])) if ms >= 50 else -1)

    # ---- the loop ----

    async def probe(self) -> None:
        self.loop_thread = threading.get_ident()
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.01)
            now = time.monotonic()
            self.tick = now
            late = (now - t - 0.01) * 1000
            if late >= 20:
                self.write("lag", ms=round(late, 1))

    def _watchdog(self) -> None:
        dumped = 0.0
        while not self._stop.wait(0.05):
            now = time.monotonic()
            if self.loop_thread is None or now - self.tick < 0.15 or self.tick == dumped:
                continue
            dumped = self.tick
            frames = sys._current_frames()
            names = {t.ident: t.name for t in threading.enumerate()}
            stacks = {f"{names.get(tid, tid)}{'*' if tid == self.loop_thread else ''}":
                      traceback.format_stack(frame)[-12:] for tid, frame in frames.items()
                      if tid != threading.get_ident()}
            self.write("stuck", ms=round((now - self.tick) * 1000, 1), stacks=stacks)

    def start(self) -> StallLog:
        gc.callbacks.append(self._on_gc)
        threading.Thread(target=self._watchdog, name="stall-watchdog", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)


class SlowRequests:
    """Pure ASGI middleware (outermost): logs requests slower than 50 ms."""

    def __init__(self, app, *, log: StallLog) -> None:
        self.app, self.log = app, log
        self._probe = None

    async def __call__(self, scope, receive, send) -> None:
        if self._probe is None:
            self._probe = asyncio.ensure_future(self.log.probe())
        t = time.perf_counter()
        try:
            await self.app(scope, receive, send)
        finally:
            ms = (time.perf_counter() - t) * 1000
            if ms >= 50 and scope["type"] == "http":
                q = scope.get("query_string", b"").decode()
                self.log.write("slow", path=scope["path"] + ("?" + q if q else ""), ms=round(ms, 1))


def timed_handler(log: StallLog, handler):
    """``handler`` (an informer batch handler) with its time logged when >= 5 ms."""

    def run(batch) -> None:
        t = time.perf_counter()
        handler(batch)
        ms = (time.perf_counter() - t) * 1000
        if ms >= 5:
            log.write("fold", ms=round(ms, 1), changes=len(batch.changes), initial=batch.initial,
                      resync=batch.resync)

    return run


def from_env() -> StallLog | None:
    path = os.environ.get(ENV)
    return StallLog(path).start() if path else None
