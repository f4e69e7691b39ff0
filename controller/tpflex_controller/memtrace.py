"""Debug aid: where the controller's memory goes, at SIGUSR1 and at exit.

Off unless the environment has ``TPFLEX_DEBUG_MEMTRACE_FRAMES=N`` (a debug switch, not a
setting; the older name ``TPFLEX_MEMTRACE_FRAMES`` works too, but bench/load.py passes only
``TPFLEX_DEBUG_*`` variables on to the controller: tracing starts in ``main()`` before the
controller starts, N frames per allocation, in this process only, not in the REST child,
which is a fresh interpreter) or the interpreter traces already
(``PYTHONTRACEMALLOC=N``, which every child inherits). Then each SIGUSR1, and the exit,
writes ``tpflex-memtrace-<pid>-<n>.txt`` to the temporary directory: tracemalloc's traced
total next to VmRSS, the top allocations grouped by traceback that grew since the first
dump and since the previous one, and (to tell live objects from allocator fragmentation)
VmRSS again after glibc's ``malloc_trim(0)`` (both taken before the dump's own work),
glibc's mallinfo2 (held by its arenas, allocated, free but kept, mapped apart), the cyclic
collector's runs per generation and frozen objects, plus pymalloc's arena counts. The trim
changes the process's RSS from then on: a diagnostic, never for production.
``TPFLEX_DEBUG_MEMTRACE_FRAMES=0`` writes the same dumps without tracing (no traced figures
or diffs): the allocator's account of a process running at full speed.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import io
import os
import signal
import sys
import tempfile
import threading
import tracemalloc
from pathlib import Path

TOP = 25


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return -1.0


def _pymalloc_arenas() -> str:
    """The arena, block and pool totals of sys._debugmallocstats() (it writes to the C
    stderr; nothing while tracemalloc traces)."""
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode(errors="replace")
    keep = ("arena", "# bytes in", "unused pools")  # arenas, live and free blocks, empty pools
    return "\n".join(line for line in text.splitlines() if any(k in line for k in keep))


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]


def malloc_stats() -> str:
    """glibc's own account (mallinfo2, all arenas): bytes its arenas hold from the system
    (``arena``), how much of that is allocated (``uordblks``) and free but kept
    (``fordblks``), and the blocks mapped on their own (``hblkhd``); "" off glibc."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return ""
    fn.restype = _Mallinfo2
    m = fn()
    mb = {k: getattr(m, k) / 2**20 for k in ("arena", "uordblks", "fordblks", "hblkhd")}
    return (f"malloc_arena_mb={mb['arena']:.1f} malloc_used_mb={mb['uordblks']:.1f} "
            f"malloc_free_mb={mb['fordblks']:.1f} malloc_mmap_mb={mb['hblkhd']:.1f} "
            f"malloc_arenas={_arena_count()}")


def _arena_count() -> int:
    """glibc's arenas (``<heap nr=`` entries of malloc_info); -1 if it cannot say."""
    libc = ctypes.CDLL("libc.so.6")
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    with tempfile.NamedTemporaryFile() as tmp:
        fp = libc.fopen(tmp.name.encode(), b"w")
        if not fp:
            return -1
        try:
            libc.malloc_info(0, fp)
        finally:
            libc.fclose(fp)
        return Path(tmp.name).read_text().count("<heap nr=")


def _trim() -> int:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return -1


def _diff(out: io.StringIO, title: str, new: tracemalloc.Snapshot, old: tracemalloc.Snapshot) -> None:
    stats = new.compare_to(old, "traceback")
    grown = sum(s.size_diff for s in stats)
    out.write(f"\n## {title}: traced diff {grown / 2**20:+.2f} MiB in {len(stats)} tracebacks\n")
    for s in stats[:TOP]:
        out.write(f"\n{s.size_diff / 1024:+.1f} KiB ({s.count_diff:+d} blocks), now {s.size / 1024:.1f} KiB\n")
        for line in s.traceback.format(limit=8):
            out.write(f"  {line}\n")


class MemTrace:
    """The snapshots wait on disk between dumps (kept in memory, the first one alone
    added tens of MB to the RSS it was meant to explain)."""

    def __init__(self) -> None:
        self._first: Path | None = None
        self._last: Path | None = None
        self._n = 0
        self._lock = threading.Lock()

    def dump(self) -> Path | None:
        with self._lock:
            # RSS and the trim first: the dump's own temporaries are not in them
            rss = rss_mb()
            glibc = malloc_stats()
            collections = "/".join(str(g["collections"]) for g in gc.get_stats())
            traced = ""
            if tracemalloc.is_tracing():
                current, peak = tracemalloc.get_traced_memory()
                traced = (f" traced_mb={current / 2**20:.1f} traced_peak_mb={peak / 2**20:.1f} "
                          f"tracemalloc_overhead_mb={tracemalloc.get_tracemalloc_memory() / 2**20:.1f}")
            trimmed = _trim()
            trimmed_rss = rss_mb()
            out = io.StringIO()
            out.write(f"# dump {self._n} pid={os.getpid()} rss_mb={rss:.1f}{traced} malloc_trim(0)={trimmed} "
                      f"rss_mb_after_trim={trimmed_rss:.1f} {glibc} gc_collections={collections} "
                      f"gc_frozen={gc.get_freeze_count()}\n")
            path = Path(tempfile.gettempdir()) / f"tpflex-memtrace-{os.getpid()}-{self._n}.txt"
            if traced:
                self._diffs(out, path.with_suffix(".snapshot"))
            out.write("\n## pymalloc\n" + _pymalloc_arenas() + "\n")
            self._n += 1
            path.write_text(out.getvalue())
            return path

    def _diffs(self, out: io.StringIO, kept: Path) -> None:
        """The traced allocations that grew since the first and the previous dump."""
        filters = [tracemalloc.Filter(False, tracemalloc.__file__)]
        snap = tracemalloc.take_snapshot().filter_traces(filters)
        if self._first is not None:
            _diff(out, "since the first dump", snap, tracemalloc.Snapshot.load(str(self._first)))
        if self._last is not None and self._last != self._first:
            _diff(out, "since the previous dump", snap, tracemalloc.Snapshot.load(str(self._last)))
        snap.dump(str(kept))
        del snap
        if self._first is None:
            self._first = kept
        elif self._last != self._first and self._last is not None:
            self._last.unlink(missing_ok=True)
        self._last = kept

ENV = "TPFLEX_DEBUG_MEMTRACE_FRAMES"
OLD_ENV = "TPFLEX_MEMTRACE_FRAMES"  # bench/load.py does not pass it to the controller


def install_if_asked(environ=os.environ) -> MemTrace | None:
    """Dump at SIGUSR1 and at exit when asked to trace; call from the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return None
    frames = environ.get(ENV, "") or environ.get(OLD_ENV, "")
    if frames.isdigit() and int(frames) > 0 and not tracemalloc.is_tracing():
        tracemalloc.start(int(frames))
    if not tracemalloc.is_tracing() and frames != "0":
        return None
    mt = MemTrace()
    # the dump runs in a thread: a signal handler must not take locks the loop holds
    signal.signal(signal.SIGUSR1, lambda *_: threading.Thread(target=mt.dump, daemon=True).start())
    atexit.register(mt.dump)
    return mt
