"""Give the heap's free pages back to the operating system while the loop is idle.

CPython hands allocations over 512 bytes (protobuf messages, plan bytes, the bytes of
watch events) to the C library's malloc. Under a steady stream of watch events glibc
keeps the freed memory of its heaps for reuse rather than returning it, and the
controller's resident size grows beyond what its live objects use (``memtrace.py`` reports
both, and the RSS after a trim).
``malloc_trim(0)`` returns the free pages of every heap; it walks the heaps (10-30 ms
measured on a fragmented 100 MB heap), so the loop calls it when idle and at most once
per interval. Off the C library's malloc (no ``malloc_trim``), it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable


def libc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class HeapTrimmer:
    """``maybe_trim()`` trims when ``interval_s`` has passed since the last trim."""

    def __init__(
        self,
        interval_s: float = 30.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        trim: Callable[[int], int] | None = ...,  # default: glibc's (libc_trim)
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._interval = interval_s
        self._clock = clock
        self._trim = libc_trim() if trim is ... else trim
        self._next = clock() + interval_s
        self.trims = 0

    def maybe_trim(self) -> bool:
        if self._trim is None:
            return False
        now = self._clock()
        if now < self._next:
            return False
        self._next = now + self._interval
        self._trim(0)
        self.trims += 1
        return True
