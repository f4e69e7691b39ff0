"""The controller's C heap (glibc malloc): few arenas, and free memory given back.

CPython's objects up to 512 bytes live in pymalloc's arenas; everything larger (protobuf
and gRPC buffers, etcd responses, a metrics exposition, big lists and dicts) comes from
glibc's malloc, which keeps what is freed for reuse. Three habits of glibc grew the
controller's RSS under the load benchmark while its live Python objects did not
(docs/reliability.md, issue 14):

- one arena per thread, up to 8 per core (16 in a controller on 2 cores): each keeps its
  own free memory, and a thread's next allocation does not reuse another arena's;
- free memory inside a heap (below its top) is given back only by ``malloc_trim``; the
  automatic trim releases the top of a heap only;
- blocks of 128 KiB or more are mapped apart, but each such block freed raises that
  threshold to its size (up to 32 MiB): from then on big transient buffers stay in the
  arenas when freed.

:func:`limit_arenas` caps the arenas (``mallopt(M_ARENA_MAX)``) and fixes the threshold
(``M_MMAP_THRESHOLD``, 256 KiB) before the process starts its threads, and puts
``MALLOC_ARENA_MAX`` and ``MALLOC_MMAP_THRESHOLD_`` in the environment its children (the
REST process) inherit; either already in the environment wins (glibc applied it when the
process started; the systemd unit sets both). :class:`HeapTrimmer` calls
``malloc_trim(0)`` on a timer, on its own thread (ctypes releases the GIL; glibc locks one
arena at a time). Both do nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, MutableMapping

from tpflex_controller.periodic import Periodic

log = logging.getLogger(__name__)

ENV = "MALLOC_ARENA_MAX"
ARENA_MAX = 2  # the arenas a controller process keeps (its own and its REST child's)
MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"
MMAP_THRESHOLD = 256 << 10  # blocks this large or larger are mapped apart, unmapped when freed
TRIM_INTERVAL_S = 30.0
_M_ARENA_MAX, _M_MMAP_THRESHOLD = -8, -3  # malloc.h


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018  (glibc only)
    except (OSError, AttributeError):
        return None
    return libc


def limit_arenas(n: int = ARENA_MAX, environ: MutableMapping[str, str] = os.environ) -> int | None:
    """Cap glibc's arenas at ``n`` in this process and its children, and fix the size from
    which blocks are mapped apart at ``MMAP_THRESHOLD`` (glibc raises it as big blocks are
    freed, up to 32 MiB, and from then on keeps such blocks, a metrics exposition or a
    batch of watch events, in the arenas). Call before threads start (arenas made earlier
    stay). Returns the arena cap in force (``MALLOC_ARENA_MAX`` when the environment has
    one: glibc applied it at start, as it did ``MALLOC_MMAP_THRESHOLD_``), None without
    glibc."""
    if n < 1:
        raise ValueError("need n >= 1")
    libc = _glibc()
    if libc is None:
        return None
    if not environ.get(MMAP_ENV, "").isdigit() and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1:
        environ[MMAP_ENV] = str(MMAP_THRESHOLD)
    given = environ.get(ENV, "")
    if given.isdigit() and int(given) > 0:
        return int(given)  # glibc read it at start; the children inherit it
    if libc.mallopt(_M_ARENA_MAX, n) != 1:
        return None
    environ[ENV] = str(n)
    return n


def trim() -> bool:
    """Give the heap's free memory back to the system; False without glibc or if nothing
    could be given back."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


class HeapTrimmer(Periodic):
    """``malloc_trim(0)`` every ``interval_s`` until ``stop()``; ``runs`` counts them,
    ``seconds`` is the time spent trimming (all runs). Without glibc it never starts."""

    def __init__(self, interval_s: float = TRIM_INTERVAL_S,
                 trim_fn: Callable[[], bool] = trim) -> None:
        super().__init__(interval_s, trim_fn, "heap-trim")

    def start(self) -> HeapTrimmer:
        if _glibc() is not None:
            super().start()
        return self
