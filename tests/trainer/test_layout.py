"""Layout functions (pure): hypothesis properties and typed errors."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tpflex_trainer.ntp.config import GPTConfig, param_specs, partner_pairs
from tpflex_trainer.ntp.errors import LayoutError
from tpflex_trainer.ntp.layout import (
    JobLayout,
    Member,
    ReplicaLayout,
    ReplicaPlacement,
    balanced_sizes,
    check_partners,
    plan_layout,
    replica_traffic,
)
from tpflex_trainer.ntp.reshard_plan import lower_bound_units, plan_reshard

BASE_TP = 6


@st.composite
def placements(draw, base_tp: int = BASE_TP, max_replicas: int = 4):
    n = draw(st.integers(1, max_replicas))
    out = []
    for r in range(n):
        slots = draw(st.lists(st.integers(0, base_tp - 1), min_size=1, max_size=base_tp, unique=True))
        out.append(ReplicaPlacement(r, tuple(slots), draw(st.integers(1, 3))))
    return tuple(out)


unit_counts = st.fixed_dictionaries({"kv_groups": st.integers(6, 13), "ffn": st.integers(6, 40)})


def brute_force_traffic_bound(n: int, degree: int, parts: list[int]) -> int:
    """Fewest units on extra ranks over every assignment of balanced shard sizes to ranks
    (cores first), each core keeping at most its partition."""
    best = n
    for sizes in set(itertools.permutations(balanced_sizes(n, degree))):
        kept = sum(min(parts[p], sizes[p]) for p in range(len(parts)))
        best = min(best, n - kept)
    return best


def assert_invariants(layout: JobLayout, counts: dict[str, int]) -> None:
    for fam, n in counts.items():
        parts = layout.partitions[fam]
        assert len(parts) == layout.t_min
        assert sorted(u for p in parts for u in p) == list(range(n))  # partitions cover once
        part_of = layout.partition_of(fam)
        for rep in layout.replicas:
            owned = [u for m in rep.members for u in m.units[fam]]
            assert sorted(owned) == list(range(n)), "every unit owned exactly once per replica"
            sizes = [len(m.units[fam]) for m in rep.members]
            assert max(sizes) - min(sizes) <= 1, "balanced shards"
            for m in rep.members:
                assert (m.tp_rank < layout.t_min) == m.core
                if m.core:
                    assert all(part_of[u] == m.tp_rank for u in m.units[fam]), "core holds its partition"
            if rep.degree == layout.t_min:
                assert [m.units[fam] for m in rep.members] == list(parts)
            traffic = replica_traffic(layout, rep.replica)[fam]
            assert traffic == brute_force_traffic_bound(n, rep.degree, [len(p) for p in parts])


@settings(max_examples=150, deadline=None)
@given(counts=unit_counts, plan=placements())
def test_initial_layout_invariants(counts, plan):
    layout = plan_layout(counts, plan, BASE_TP)
    assert_invariants(layout, counts)
    for parts in layout.partitions.values():  # initial core partitions are contiguous
        assert all(list(p) == list(range(p[0], p[-1] + 1)) for p in parts)


@settings(max_examples=150, deadline=None)
@given(counts=unit_counts, plans=st.lists(placements(), min_size=2, max_size=4), data=st.data())
def test_transitions_keep_invariants_and_move_the_minimum(counts, plans, data):
    layout = plan_layout(counts, plans[0], BASE_TP)
    for plan in plans[1:]:
        members = [m.member for m in layout.members()]
        holders = data.draw(st.lists(st.sampled_from(members), unique=True, min_size=1))
        new = plan_layout(counts, plan, BASE_TP, layout, holders)
        assert_invariants(new, counts)
        moves = plan_reshard(layout, new, holders)
        lower = lower_bound_units(layout, new, holders)
        moved: dict[str, int] = {}
        for t in moves.transfers:
            moved[t.family] = moved.get(t.family, 0) + 1
            assert t.src in holders and t.unit in layout.member(t.src).units.get(t.family, (0,))
        for fam, units in moves.missing.items():
            moved[fam] = moved.get(fam, 0) + sum(
                1 for m in new.members() for u in m.units.get(fam, (0,)) if u in units
            )
        assert moved == {f: n for f, n in lower.items() if n}
        pairs = {(t.dst, t.family, t.unit) for t in moves.transfers}
        assert len(pairs) == len(moves.transfers), "each needed unit arrives once"
        layout = new


@settings(max_examples=100, deadline=None)
@given(counts=unit_counts, degree=st.integers(2, BASE_TP), data=st.data())
def test_drain_moves_only_the_departing_members_units(counts, degree, data):
    start = (ReplicaPlacement(0, tuple(range(degree))),)
    layout = plan_layout(counts, start, BASE_TP)
    gone = data.draw(st.integers(0, degree - 1))
    after = (ReplicaPlacement(0, tuple(s for s in range(degree) if s != gone)),)
    new = plan_layout(counts, after, BASE_TP, layout)
    moves = plan_reshard(layout, new, [m.member for m in layout.members()])
    departing = layout.member(Member(0, gone))
    for fam in counts:
        assert sum(1 for t in moves.transfers if t.family == fam) == len(departing.units[fam])
    assert all(t.src == departing.member for t in moves.transfers if t.family in counts)


def test_peer_recovery_takes_lost_units_from_the_other_replica():
    counts = {"kv_groups": 8, "ffn": 16}
    start = (ReplicaPlacement(0, tuple(range(8))), ReplicaPlacement(1, tuple(range(8))))
    layout = plan_layout(counts, start, 8)
    lost = Member(1, 5)
    holders = [m.member for m in layout.members() if m.member != lost]
    after = (ReplicaPlacement(0, tuple(range(8))), ReplicaPlacement(1, (0, 1, 2, 3, 4, 6, 7)))
    new = plan_layout(counts, after, 8, layout, holders)
    moves = plan_reshard(layout, new, holders)
    assert not moves.missing
    assert {t.unit for t in moves.transfers if t.family == "kv_groups"} == set(layout.member(lost).units["kv_groups"])
    assert all(t.peer and t.src.replica == 0 for t in moves.transfers if t.family != "_replicated")
    assert replica_traffic(new, 0) == {"kv_groups": 1, "ffn": 2}  # = (8 - 7) / 8 of the units
    assert all(t.dst.replica == 1 for t in moves.transfers)  # the healthy replica stays put


def test_units_with_no_live_holder_are_reported_missing():
    counts = {"kv_groups": 4}
    layout = plan_layout(counts, (ReplicaPlacement(0, (0, 1, 2, 3)),), 4)
    holders = [Member(0, s) for s in (0, 1, 3)]
    new = plan_layout(counts, (ReplicaPlacement(0, (0, 1, 3)),), 4, layout, holders)
    assert plan_reshard(layout, new, holders).missing == {"kv_groups": layout.member(Member(0, 2)).units["kv_groups"]}


def test_partners_are_co_located_in_every_layout():
    cfg = GPTConfig()
    specs = {s.name: s for s in param_specs(cfg)}
    pairs = partner_pairs(list(specs.values()))
    assert len(pairs) == 2 * cfg.n_layers
    for col, _, row, _ in pairs:
        assert specs[col].family == specs[row].family  # same family => same units per member


@pytest.mark.parametrize(
    ("counts", "plan", "base_tp", "code"),
    [
        ({"ffn": 8}, (), 4, "no_replicas"),
        ({"ffn": 8}, (ReplicaPlacement(0, ()),), 4, "degree_zero"),
        ({"ffn": 8}, (ReplicaPlacement(0, tuple(range(5))),), 4, "degree_above_domain"),
        ({"ffn": 3}, (ReplicaPlacement(0, (0, 1, 2, 3)),), 4, "more_ranks_than_units"),
        ({"ffn": 8}, (ReplicaPlacement(0, (0, 0)),), 4, "duplicate_slot"),
        ({"ffn": 8}, (ReplicaPlacement(0, (0, 4)),), 4, "slot_out_of_range"),
        ({"ffn": 8}, (ReplicaPlacement(0, (0,)), ReplicaPlacement(0, (1,))), 4, "duplicate_replica"),
        ({"ffn": 8}, (ReplicaPlacement(0, (0,), local_batch=0),), 4, "bad_local_batch"),
    ],
)
def test_unsatisfiable_requests_raise_typed_errors(counts, plan, base_tp, code):
    with pytest.raises(LayoutError) as err:
        plan_layout(counts, plan, base_tp)
    assert err.value.code == code
    assert str(err.value)


def test_partner_unit_mismatch_is_refused():
    with pytest.raises(LayoutError) as err:
        check_partners([("h0.mlp.fc.weight", 8, "h0.mlp.proj.weight_t", 4)])
    assert err.value.code == "partner_unit_mismatch" and "h0.mlp.proj.weight_t" in str(err.value)


@settings(max_examples=100, deadline=None)
@given(counts=unit_counts, plans=st.lists(placements(), min_size=3, max_size=3), data=st.data())
def test_layouts_after_an_interrupted_reshard(counts, plans, data):
    """Some members already hold their units of the new layout, others still those of the
    old one (a unit may be held twice): the next layout is still valid and every needed
    unit arrives once, from a member that holds it."""
    old = plan_layout(counts, plans[0], BASE_TP)
    new = plan_layout(counts, plans[1], BASE_TP, old)
    reports: dict[Member, object] = {}
    for m in [*old.members(), *new.members()]:
        if m.member not in reports or data.draw(st.booleans()):
            reports[m.member] = m
    replicas = []
    for r in sorted({m.replica for m in reports}):
        members = tuple(sorted((reports[m] for m in reports if m.replica == r), key=lambda x: x.tp_rank))
        replicas.append(ReplicaLayout(r, 1, members))
    mixed = JobLayout(BASE_TP, old.families, 0, {}, tuple(replicas))
    after = plan_layout(counts, plans[2], BASE_TP, mixed)
    assert_invariants(after, counts)
    moves = plan_reshard(mixed, after, list(reports))
    assert not moves.missing
    assert len({(t.dst, t.family, t.unit) for t in moves.transfers}) == len(moves.transfers)
    for t in moves.transfers:
        assert t.family == "_replicated" or t.unit in reports[t.src].units[t.family]
