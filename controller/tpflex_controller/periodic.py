"""One piece of work every ``interval_s`` on a daemon thread (the controller's heap trimmer,
the REST process's full collections)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Periodic:
    """``work()`` every ``interval_s`` until ``stop()``; ``runs`` counts the runs and
    ``seconds`` sums their time; ``wait_runs`` lets a caller await them."""

    def __init__(self, interval_s: float, work: Callable[[], object], name: str) -> None:
        if interval_s <= 0:
            raise ValueError("need interval_s > 0")
        self.interval_s = interval_s
        self.runs = 0
        self.seconds = 0.0
        self._work = work
        self._stop = threading.Event()
        self._ran = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(5)

    def wait_runs(self, n: int, timeout: float) -> bool:
        with self._ran:
            return self._ran.wait_for(lambda: self.runs >= n, timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            t = time.perf_counter()
            self._work()
            with self._ran:
                self.seconds += time.perf_counter() - t
                self.runs += 1
                self._ran.notify_all()
