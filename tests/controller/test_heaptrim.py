"""The idle heap trim (heaptrim.py): at most once per interval, on an injected clock;
nothing where the C library has no malloc_trim."""

from __future__ import annotations

import pytest
from tpflex_controller.heaptrim import HeapTrimmer, libc_trim


def test_trims_at_most_once_per_interval():
    now = [100.0]
    calls: list[int] = []
    t = HeapTrimmer(30.0, clock=lambda: now[0], trim=lambda pad: calls.append(pad) or 1)
    assert not t.maybe_trim()  # the first interval has not passed
    now[0] = 130.0
    assert t.maybe_trim() and calls == [0]
    now[0] = 159.9
    assert not t.maybe_trim()
    now[0] = 160.0
    assert t.maybe_trim() and t.trims == 2 and calls == [0, 0]


def test_without_malloc_trim_nothing_happens():
    t = HeapTrimmer(1.0, clock=lambda: 1e9, trim=None)  # libc_trim() found none
    assert not t.maybe_trim() and t.trims == 0


def test_the_real_trim_runs_here():
    trim = libc_trim()
    if trim is None:
        pytest.skip("no glibc malloc_trim on this system")
    assert trim(0) in (0, 1)


def test_a_bad_interval_is_refused():
    with pytest.raises(ValueError):
        HeapTrimmer(0.0)
