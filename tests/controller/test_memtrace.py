"""The debug memory dump (memtrace.py): off without its switch; with it, a dump names the
allocation that grew between two dumps and reports RSS next to the traced total."""

from __future__ import annotations

import atexit
import signal
import tracemalloc

from tpflex_controller import memtrace


def test_off_without_the_switch():
    assert not tracemalloc.is_tracing()
    assert memtrace.install_if_asked({}) is None
    assert memtrace.install_if_asked({memtrace.ENV: "nope"}) is None
    assert not tracemalloc.is_tracing()


def test_a_dump_names_what_grew(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(memtrace.tempfile, "tempdir", None)
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        mt = memtrace.install_if_asked({memtrace.ENV: "4"})
        assert mt is not None and tracemalloc.is_tracing()
        mt.dump()
        kept = [bytearray(4096) for _ in range(2000)]  # ~8 MiB that stays alive
        text = mt.dump().read_text()
    finally:
        atexit.unregister(mt.dump)
        tracemalloc.stop()
        signal.signal(signal.SIGUSR1, previous)
    assert len(kept) == 2000
    head, _, rest = text.partition("\n")
    assert "rss_mb=" in head and "traced_mb=" in head
    first = rest.split("\n## since the first dump")[1].split("\n\n")[1]  # the biggest growth
    assert "test_memtrace.py" in first and float(first.split(" KiB")[0]) > 7000
    assert "malloc_trim(0)=" in head and "rss_mb_after_trim=" in head
