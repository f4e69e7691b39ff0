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
WATTS = [700.0, 812.0, 950.0]


@st.composite
def a_part(draw):
    gpus = tuple(draw(st.lists(st.sampled_from(GPUS), unique=True, max_size=6)))
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
        assert many(list(GPUS)) == [want.get(g) for g in GPUS]
    for g in GPUS:  # point look-ups first: through the index, before any whole-map walk
        assert (g in caps) == (g in want)
        assert caps.get(g) == want.get(g)
        assert (caps[g] if g in want else None) == want.get(g)
    assert len(caps) == len(want)
    assert dict(caps) == want and caps == want and want == caps and dict(caps.items()) == want
    assert sorted(caps) == sorted(want)
    for g in GPUS:  # and from the walked dict
        assert caps.get(g) == want.get(g) and (g in caps) == (g in want)
    if many is not None:
        assert many(list(reversed(GPUS))) == [want.get(g) for g in reversed(GPUS)]


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(st.lists(a_part(), max_size=6), st.data())
def test_merged_caps_equal_dict_updates_also_when_derived(parts, data):
    """Also when derived maps index afresh (a small limit of differing replicas) and when
    they fold their own overlay entries into a new shared one (a small limit of those)."""
    limit = data.draw(st.sampled_from([2, caps_module._MAX_DIRTY]))
    recent = data.draw(st.sampled_from([0, 3, caps_module._MAX_RECENT]))
    saved = caps_module._MAX_DIRTY, caps_module._MAX_RECENT
    caps_module._MAX_DIRTY, caps_module._MAX_RECENT = limit, recent
    try:
        _derive_and_compare(parts, data)
    finally:
        caps_module._MAX_DIRTY, caps_module._MAX_RECENT = saved


def _derive_and_compare(parts, data) -> None:
    current = {i: p for i, p in enumerate(parts) if p}
    caps = MergedCaps(current)
    _assert_same(caps, _reference(current))
    for _ in range(data.draw(st.integers(0, 12))):
        replanned = data.draw(st.sets(st.integers(0, 7), max_size=3))
        current = dict(current)
        for i in replanned:
            current.pop(i, None)
            new = data.draw(a_part())
            if new:
                current[i] = new
        caps = caps.derive(current, replanned)
        _assert_same(caps, _reference(current))


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
