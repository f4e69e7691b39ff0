"""The collective watchdog and the communicator abort.

``Watchdog`` watches the part of a training step that runs collectives (the plan
agreement and the step itself, entered with ``guard()``); when one stays inside longer
than ``after_s`` -- always shorter than the collective timeout -- it calls ``on_hang``
once (the hooks abort the process groups and report the hang in their next beat).

``abort_groups`` aborts every process group of the runtime and the default group. With
NCCL (and ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``: clean up, do not tear the process down)
this ends a collective blocked in another thread at once. With gloo ``abort`` does
nothing (torch 2.13: a blocked gloo collective ends when a peer's sockets close, or at
the collective timeout); the same code runs, so the recovery path is one.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch.distributed as dist

log = logging.getLogger(__name__)


def dump_stacks(why: str) -> None:
    """Every thread's Python stack to stderr (a rank's log), for a collective that does not
    end: where the main thread waits says which group and which peer."""
    log.warning("thread stacks follow why=%s", why)
    try:
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except (OSError, ValueError, AttributeError) as exc:  # stderr closed or not a real file
        log.info("thread stacks not dumped error=%s", exc)


def abort_groups(groups: Iterable, reason: str) -> int:
    """Abort ``groups`` (e.g. the runtime's) and the default group; returns how many were
    aborted. Safe from any thread and on groups already destroyed."""
    groups = [g for g in list(groups) if g is not None]
    if dist.is_initialized() and dist.group.WORLD is not None:
        groups.append(dist.group.WORLD)
    n = 0
    for group in groups:
        try:
            group.abort()
            n += 1
        except (RuntimeError, ValueError, AttributeError) as exc:
            log.info("process group not aborted error=%s", exc)
    log.warning("process groups aborted groups=%d reason=%s", n, reason)
    return n


class Watchdog:
    def __init__(self, after_s: float, on_hang: Callable[[float], None], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not after_s > 0:
            raise ValueError(f"watchdog limit must be > 0, got {after_s}")
        self.after_s, self.on_hang, self.clock = after_s, on_hang, clock
        self.fired = 0  # how often it fired (for logs and tests)
        self._lock = threading.Lock()
        self._since: float | None = None
        self._hung_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tpflex-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    @contextmanager
    def guard(self) -> Iterator[None]:
        with self._lock:
            self._since, self._hung_at = self.clock(), None
        try:
            yield
        finally:
            with self._lock:
                self._since = self._hung_at = None

    def since(self) -> float | None:
        """When the guarded section now running was entered (``clock``), or None."""
        with self._lock:
            return self._since

    def hung_s(self) -> float:
        """How long the guarded section has been stuck, once the watchdog fired; else 0."""
        with self._lock:
            if self._since is None or self._hung_at is None:
                return 0.0
            return self.clock() - self._since

    def check(self) -> bool:
        """Fire if the guarded section is over the limit (once per section)."""
        with self._lock:
            if self._since is None or self._hung_at is not None:
                return False
            stuck = self.clock() - self._since
            if stuck <= self.after_s:
                return False
            self._hung_at = self.clock()
            self.fired += 1
        self.on_hang(stuck)
        return True

    def _loop(self) -> None:
        period = min(1.0, self.after_s / 4)
        while not self._stop.wait(period):
            try:
                self.check()
            except Exception:  # a watchdog that dies silently watches nothing
                log.exception("watchdog check failed")
