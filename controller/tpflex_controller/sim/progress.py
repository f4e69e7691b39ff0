"""A plain-text progress bar on a stream (stderr), redrawn in place; no dependency."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    def __init__(self, label: str, stream: TextIO | None = None, width: int = 30) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self._started = time.monotonic()
        self._last_pct = -1

    def __call__(self, fraction: float) -> None:
        fraction = min(max(fraction, 0.0), 1.0)
        pct = int(fraction * 100)
        if pct == self._last_pct:
            return
        self._last_pct = pct
        filled = int(fraction * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.monotonic() - self._started
        end = "\n" if pct == 100 else ""
        self.stream.write(f"\r{self.label} [{bar}] {pct:3d}% {elapsed:6.1f}s{end}")
        self.stream.flush()
