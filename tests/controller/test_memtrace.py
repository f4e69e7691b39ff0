"""The debug memory dump (memtrace.py): off without its switch; with it, a dump names the
allocation that grew between two dumps and reports RSS next to the traced total."""

from __future__ import annotations

import atexit
import signal
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

from tpflex_controller import memtrace


def test_off_without_the_switch():
    assert not tracemalloc.is_tracing()
    assert memtrace.install_if_asked({}) is None
    assert memtrace.install_if_asked({memtrace.ENV: "nope"}) is None
    assert not tracemalloc.is_tracing()


@contextmanager
def _installed(frames: str, tmp_path, monkeypatch):
    """memtrace installed with ``frames``, dumping into ``tmp_path``; afterwards no tracing,
    no exit dump and the previous SIGUSR1 handler."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(memtrace.tempfile, "tempdir", None)
    previous = signal.getsignal(signal.SIGUSR1)
    mt = None
    try:
        mt = memtrace.install_if_asked({memtrace.ENV: frames})
        assert mt is not None
        yield mt
    finally:
        if mt is not None:
            atexit.unregister(mt.dump)
        tracemalloc.stop()
        signal.signal(signal.SIGUSR1, previous)


def test_a_dump_names_what_grew(tmp_path, monkeypatch):
    with _installed("4", tmp_path, monkeypatch) as mt:
        assert tracemalloc.is_tracing()
        mt.dump()
        kept = [bytearray(4096) for _ in range(2000)]  # ~8 MiB that stays alive
        text = mt.dump().read_text()
    assert len(kept) == 2000
    head, _, rest = text.partition("\n")
    assert "rss_mb=" in head and "traced_mb=" in head
    first = rest.split("\n## since the first dump")[1].split("\n\n")[1]  # the biggest growth
    assert "test_memtrace.py" in first and float(first.split(" KiB")[0]) > 7000
    assert "malloc_trim(0)=" in head and "rss_mb_after_trim=" in head
    # glibc's account: what its arenas hold, of it allocated and free; ~8 MiB of 4 KiB
    # blocks lives in them, not in pymalloc (which serves blocks up to 512 bytes)
    glibc = dict(kv.split("=") for kv in head.split() if kv.startswith("malloc_") and kv.endswith(tuple("0123456789")))
    assert float(glibc["malloc_arena_mb"]) >= float(glibc["malloc_used_mb"]) > 7.5
    assert "gc_collections=" in head and "gc_frozen=" in head
    assert int(glibc["malloc_arenas"]) >= 1


def test_frames_zero_dumps_without_tracing(tmp_path, monkeypatch):
    """``=0``: the allocator's account (RSS, glibc, the collector, pymalloc), no tracing."""
    with _installed("0", tmp_path, monkeypatch) as mt:
        assert not tracemalloc.is_tracing()
        text = mt.dump().read_text()
    head = text.partition("\n")[0]
    assert "rss_mb=" in head and "malloc_arenas=" in head and "traced_mb" not in head
    assert "since the first dump" not in text
    assert "arenas allocated current" in text.split("## pymalloc")[1]
    assert "# bytes in allocated blocks" in text.split("## pymalloc")[1]
    assert not list(tmp_path.glob("*.snapshot"))


def test_the_process_entry_installs_it_not_the_reconcile_loop(etcd_server, tmp_path, monkeypatch):
    """(And reports the process entry's arena cap, heap.py.) ``tpflex-controller`` traces from main() (its switch is a ``TPFLEX_DEBUG_*`` variable,
    which bench/load.py passes on): SIGUSR1 writes a dump of the controller's pid, none of
    the REST child's; an in-process reconcile loop started with the switch set traces
    nothing (the loop is no process entry)."""
    from tests.controller.controller_harness import ControllerProc, start_controller
    from tests.support.wait import wait_until

    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    proc = ControllerProc(etcd_server.endpoints, "c1", tmp_path,
                          env={memtrace.ENV: "1", "TMPDIR": str(tmp_path)})
    try:
        proc.wait_http()
        [child] = proc.rest_pids()
        proc.proc.send_signal(signal.SIGUSR1)
        dump = tmp_path / f"tpflex-memtrace-{proc.proc.pid}-0.txt"
        wait_until(lambda: dump.exists() and "## pymalloc" in dump.read_text(), 30, "the controller's dump")
        head = dump.read_text().partition("\n")[0]
        assert f"pid={proc.proc.pid} " in head
        # heap.py: the controller (~30 threads) keeps 2 glibc arenas, its REST child inherits the cap
        assert 1 <= int(head.split("malloc_arenas=")[1].split()[0]) <= 2
        assert b"MALLOC_ARENA_MAX=2\0" in Path(f"/proc/{child}/environ").read_bytes()
        assert proc.terminate() == 0
        assert (tmp_path / f"tpflex-memtrace-{proc.proc.pid}-1.txt").exists()  # at exit
        assert not list(tmp_path.glob(f"tpflex-memtrace-{child}-*"))
    finally:
        proc.kill()

    monkeypatch.setenv(memtrace.ENV, "1")
    ctl = start_controller(etcd_server.endpoints)
    try:
        assert not tracemalloc.is_tracing()
    finally:
        ctl.stop()
        tracemalloc.stop()
