"""The planner's cap maps and stage shortcuts equal plain per-GPU references: a stage's
uniform caps and a plan's merged caps (also derived re-plan after re-plan) behave as the
dict ``dict.update`` in replica order builds, the lost-GPU split by slices equals a filter,
and the memoised cap of a lone boosted stage equals the water-fill it stands for."""

from __future__ import annotations

import copy
import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st
from tpflex_controller.planner import GpuStatus, power
from tpflex_controller.planner import caps as caps_module
from tpflex_controller.planner.caps import MergedCaps, UniformCaps
from tpflex_controller.planner.stages import StageDraft, _split, rack_position
from tpflex_proto.powermodel import DEFAULT_POWER_MODEL

from tests.controller.planner_fixtures import make_rack, state

GPUS = [(f"n{i}", j) for i in range(4) for j in range(3)]
# replica i's own GPUs (a rack each): parts drawn from these never share a GPU
OWN = {i: [(f"r{i}", j) for j in range(3)] for i in range(8)}
ALL = GPUS + [g for gpus in OWN.values() for g in gpus]
WATTS = [700.0, 812.0, 950.0]


@st.composite
def a_part(draw, pool=GPUS):
    gpus = tuple(draw(st.lists(st.sampled_from(pool), unique=True, max_size=6)))
    if draw(st.booleans()):
        return UniformCaps(gpus, draw(st.sampled_from(WATTS)))
    return {g: draw(st.sampled_from(WATTS)) for g in gpus}


def _reference(parts: dict) -> dict:
    out: dict = {}
    for i in sorted(parts):
        out.update(dict(parts[i]))
    return out


def _assert_same(caps, want: dict) -> None:
    many = getattr(caps, "get_many", None)
    if many is not None:  # before anything else has indexed the map
        assert many(list(ALL)) == [want.get(g) for g in ALL]
    for g in ALL:  # point look-ups first: through the index, before any whole-map walk
        assert (g in caps) == (g in want)
        assert caps.get(g) == want.get(g)
        assert (caps[g] if g in want else None) == want.get(g)
    assert len(caps) == len(want)
    assert dict(caps) == want and caps == want and want == caps and dict(caps.items()) == want
    assert sorted(caps) == sorted(want)
    for g in ALL:  # and from the walked dict
        assert caps.get(g) == want.get(g) and (g in caps) == (g in want)
    if many is not None:
        assert many(list(reversed(ALL))) == [want.get(g) for g in reversed(ALL)]


@settings(max_examples=250, deadline=None, derandomize=True, database=None)
@given(st.booleans(), st.data())
def test_merged_caps_equal_dict_updates_also_when_derived(own, data):
    """Also when derived maps index afresh or patch the shared index in place (a small
    limit of differing replicas), when they fold their own overlay entries into a new
    shared one (a small limit of those), and for every earlier map of the lineage and of
    side lineages derived from earlier maps, after the index they share was patched.
    ``own``: each replica's parts on its own GPUs (the usual plan: patched in place), else
    parts that share GPUs (indexed afresh)."""
    limit = data.draw(st.sampled_from([2, caps_module._MAX_DIRTY]))
    recent = data.draw(st.sampled_from([0, 3, caps_module._MAX_RECENT]))
    saved = caps_module._MAX_DIRTY, caps_module._MAX_RECENT
    caps_module._MAX_DIRTY, caps_module._MAX_RECENT = limit, recent
    try:
        _derive_and_compare(own, data)
    finally:
        caps_module._MAX_DIRTY, caps_module._MAX_RECENT = saved


def _part(data, own: bool, i: int):
    return data.draw(a_part(OWN[i] if own else GPUS))


def _derive_and_compare(own: bool, data) -> None:
    current = {i: p for i in range(data.draw(st.integers(0, 8))) if (p := _part(data, own, i))}
    caps = MergedCaps(current)
    _assert_same(caps, _reference(current))
    maps = [(caps, current)]  # every map made, with its parts
    for _ in range(data.draw(st.integers(0, 12))):
        if data.draw(st.integers(0, 3)) == 0:  # a side lineage: from an earlier map
            caps, current = maps[data.draw(st.integers(0, len(maps) - 1))]
        replanned = data.draw(st.sets(st.integers(0, 7), max_size=3))
        current = dict(current)
        for i in replanned:
            current.pop(i, None)
            new = _part(data, own, i)
            if new:
                current[i] = new
        caps = caps.derive(current, replanned)
        _assert_same(caps, _reference(current))
        maps.append((caps, current))
    for caps, parts in maps:  # the earlier maps read what they held
        _assert_same(caps, _reference(parts))


def test_a_derived_map_past_the_limit_patches_the_shared_index_in_place():
    """Replicas on their own GPUs: the map derived past the limit of differing replicas
    becomes the root of the same index object (patched, not rebuilt), and the maps of the
    old root still read their own caps."""
    n = caps_module._MAX_DIRTY + 2
    rack = {i: [(f"q{i}", j) for j in range(3)] for i in range(n)}
    parts = {i: UniformCaps(tuple(rack[i]), 700.0) for i in range(0, n, 2)}
    first = MergedCaps(parts)
    assert first.get(rack[0][0]) == 700.0  # indexed
    index = first._owner
    maps = [(first, parts)]
    caps = first
    for i in range(n):  # one replica a re-plan: its part shrinks, moves up or appears
        parts = {**parts, i: UniformCaps(tuple(rack[i][: 1 + i % 3]), 800.0 + i)}
        caps = caps.derive(parts, {i})
        maps.append((caps, parts))
    root = caps._root
    assert root is not first and root._owner is index and first._next is not None
    assert index == {g: i for i, part in root.parts.items() for g in part}  # patched to its parts
    gpus = [g for i in range(n) for g in rack[i]]
    for m, p in maps:
        want = _reference(p)
        assert m.get_many(gpus) == [want.get(g) for g in gpus]
        assert [m.get(g) for g in gpus] == [want.get(g) for g in gpus]
        assert dict(m) == want


def test_a_part_taking_a_gpu_another_part_keeps_is_indexed_afresh(monkeypatch):
    """A re-planned part that takes a GPU of a part that stays (the higher replica's cap
    wins): the patch would lose the other holder, so the new map indexes afresh, and the
    old map still reads the GPU as it was."""
    monkeypatch.setattr(caps_module, "_MAX_DIRTY", 2)
    parts = {0: UniformCaps(tuple(OWN[0]), 700.0), 5: UniformCaps(tuple(OWN[5]), 900.0)}
    first = MergedCaps(parts)
    assert first.get(OWN[5][0]) == 900.0  # indexed
    new = {**parts, 1: UniformCaps((OWN[5][0],), 750.0), 2: UniformCaps(tuple(OWN[2]), 800.0),
           3: UniformCaps(tuple(OWN[3]), 810.0)}
    caps = first.derive(new, {1, 2, 3})
    assert caps._root is caps and caps._owner is None and first._next is None  # afresh
    _assert_same(caps, _reference(new))
    _assert_same(first, _reference(parts))


@given(st.lists(st.sampled_from(GPUS), unique=True, max_size=8), st.sampled_from(WATTS))
def test_uniform_caps_equal_dict_fromkeys(gpus, watts):
    caps = UniformCaps(tuple(gpus), watts)
    want = dict.fromkeys(gpus, watts)
    assert list(caps) == list(want) and dict(caps) == want and caps == want
    assert caps == UniformCaps(tuple(reversed(gpus)), watts)
    assert (caps == UniformCaps(tuple(gpus), watts + 1)) == (not gpus)
    for g in GPUS:
        assert (g in caps) == (g in want) and caps.get(g) == want.get(g)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.integers(1, 9), st.sampled_from([1, 2, 4]), st.booleans(), st.data())
def test_split_by_positions_equals_a_filter(size, per_node, shuffled, data):
    """Stages on a rack's first GPUs, racks listed in node order or not (then positions
    come from a scan); lost GPUs anywhere in the stage, or beyond it, or on no GPU of it."""
    rack = make_rack("r", size * per_node, per_node)
    if shuffled:
        rack = dataclasses.replace(rack, gpus=tuple(data.draw(st.permutations(rack.gpus))))
    gpus = rack.gpus[: data.draw(st.integers(1, len(rack.gpus)))]
    for g in [*rack.gpus, ("r-n0", per_node), ("elsewhere", 0)]:
        assert rack_position(rack, g) == (rack.gpus.index(g) if g in rack.gpus else 1 << 62)
    out = set(data.draw(st.lists(st.sampled_from(gpus), max_size=len(gpus))))
    usable, lost = _split(gpus, out, rack)
    assert usable == tuple(g for g in gpus if g not in out)
    assert lost == [g for g in gpus if g in out]


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from([-0.2, 0.0, 0.1, 0.4])), min_size=1, max_size=8))
def test_lone_stage_cap_memo_equals_its_water_fill(stages):
    """Whole-rack stages with 0-3 lost GPUs on racks of several budgets: the caps set with
    the plan's memo (a Curve) equal those of the water-fill per rack (the bare model)."""
    racks = {f"r{i}": make_rack(f"r{i}", 8, 2, headroom=h) for i, (_, h) in enumerate(stages)}
    drafts = []
    for (lost, _), rack in zip(stages, racks.values(), strict=True):
        usable = rack.gpus[lost:]
        lost_gpus = tuple((g, GpuStatus.FAILED) for g in rack.gpus[:lost])
        drafts.append(StageDraft(0, rack, rack.gpus, usable, lost_gpus, len(usable)))
    cluster = state(racks)
    bare = copy.deepcopy(drafts)
    power.plan_boosts(drafts, cluster, 8, power.Curve(DEFAULT_POWER_MODEL))
    power.plan_boosts(bare, cluster, 8, DEFAULT_POWER_MODEL)
    assert [(s.cap_w, s.needed_speed) for s in drafts] == [(s.cap_w, s.needed_speed) for s in bare]


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(st.integers(1, 8), st.integers(1, 8), st.sampled_from([None, 700.0, 812.0, 1000.0]))
def test_plain_stage_speed_equals_the_general_one(size, degree, cap):
    """Without pins or slow GPUs, a stage's speed is its boost's throughput."""
    rack = make_rack("r", size, 2)
    degree = min(degree, size)
    stage = StageDraft(0, rack, rack.gpus, rack.gpus, (), degree, cap_w=cap)
    curve = power.Curve(DEFAULT_POWER_MODEL)
    caps = power.gpu_caps(stage, {})
    assert power.plain_stage_speed(stage, curve) == power.stage_speed(stage, caps, {}, DEFAULT_POWER_MODEL, {})
