"""PartIndex answers a commit's questions from what it maintains (positions with several
parts, parts per generation, the top position); on random add/remove sequences the
answers equal a scan of every position."""

from __future__ import annotations

import random

from tpflex_proto.planstore import PartIndex


def _dead_by_scan(ix: PartIndex, oldest_kept: int, count: int) -> list[tuple[int, int]]:
    out = []
    for pos, gs in ix.gens.items():
        if pos >= count:
            out.extend((g, pos) for g in gs if g <= oldest_kept)
        else:
            live = max((g for g in gs if g <= oldest_kept), default=0)
            out.extend((g, pos) for g in gs if g < live)
    return sorted(out)


def _random_index(rng: random.Random, positions: int, p_add: float, value) -> PartIndex:
    """Up to 59 random adds (``value(gen, pos)``) and removes of generations 1-8."""
    ix = PartIndex()
    for _ in range(rng.randrange(1, 60)):
        gen, pos = rng.randrange(1, 9), rng.randrange(0, positions)
        if rng.random() < p_add:
            ix.add(gen, pos, value(gen, pos))
        else:
            ix.remove(gen, pos)
    return ix


def test_index_answers_equal_a_scan_of_every_position():
    rng = random.Random(11)
    for _ in range(200):
        ix = _random_index(rng, 12, 0.7, lambda gen, pos: b"v")
        top = ix.top_position()
        assert top >= max(ix.gens, default=-1) and (top == -1) == (not ix.gens)
        for generation in range(0, 10):
            assert ix.stale(generation) == sorted({g for gs in ix.gens.values() for g in gs if g > generation})
        for oldest_kept in range(1, 10):
            for count in (max(top + 1, 1), rng.randrange(0, 13)):
                want = _dead_by_scan(ix, oldest_kept, count)
                got = ix.dead(oldest_kept, count, 1000)
                assert got == want
                # under a limit: a subset of the dead parts, of that size
                few = ix.dead(oldest_kept, count, 3)
                assert set(few) <= set(want) and len(few) == min(3, len(want))


def test_release_keeps_exactly_the_values_a_generation_from_then_on_selects():
    """After ``release(g)``: every generation >= g selects what it selected before, the
    indexed generations (what commits ask about) are unchanged, and the values left are
    exactly the parts some generation >= g selects, by a scan (a part superseded at or
    before g is gone; one newer than g stays)."""
    import copy

    from tpflex_proto import codec

    rng = random.Random(5)
    for _ in range(300):
        ix = _random_index(rng, 6, 0.8, lambda gen, pos: f"{gen}/{pos}".encode())
        before = copy.deepcopy(ix)
        g = rng.randrange(1, 10)
        ix.release(g)
        assert ix.gens == before.gens
        needed = set()
        for pos, gs in before.gens.items():
            live = max((x for x in gs if x <= g), default=0)
            needed |= {(x, pos) for x in gs if x >= live}
        assert set(ix.values) == needed
        for later in range(g, 10):
            for count in range(0, 7):
                try:
                    want = before.select(later, count)
                except codec.MalformedValue:
                    want = None
                try:
                    got = ix.select(later, count)
                except codec.MalformedValue:
                    got = None
                assert got == want
        ix.add(9, 0, b"9/0")  # added again after a release: indexed and selectable
        assert ix.select(9, 1) == [b"9/0"]


def test_dead_parts_stay_right_through_interleaved_commits():
    """As a job's commits run: each asks for dead parts (under a limit, as a commit does),
    deletes some of them, adds its own parts; every answer equals the scan's."""
    rng = random.Random(5)
    for _ in range(100):
        ix = PartIndex()
        for gen in range(1, 40):
            for _ in range(rng.randrange(0, 4)):
                ix.add(gen, rng.randrange(0, 10), b"v")
            if rng.random() < 0.2:
                ix.remove(rng.randrange(1, gen + 1), rng.randrange(0, 10))
            oldest_kept = max(1, gen - rng.randrange(0, 8))
            count = ix.top_position() + 1
            want = _dead_by_scan(ix, oldest_kept, count)
            assert ix.dead(oldest_kept, count, 1000) == want
            few = ix.dead(oldest_kept, count, 3)
            assert set(few) <= set(want) and len(few) == min(3, len(want))
            for g, pos in few[: rng.randrange(0, 4)]:  # the commit deletes some of them
                ix.remove(g, pos)
