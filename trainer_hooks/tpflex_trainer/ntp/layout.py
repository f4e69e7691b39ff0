"""Unit layouts of a nonuniform-TP job: pure functions, no torch, no I/O.

A job has replicas; replica r runs at TP degree t_r on some of the ``base_tp`` slots (GPUs)
of its domain. Every sharded weight family ("kv_groups", "ffn", "vocab", ...) has ``n``
units; each replica spreads all ``n`` units over its t_r members, balanced (sizes differ by
at most one). With t_min the smallest degree of the job there are t_min *core partitions*
per family; core member p (TP rank p < t_min) of every replica holds a subset of partition
p, and extra members (TP rank >= t_min) hold the rest. A replica at t_min holds the
partitions exactly. Gradient sync then only moves the units of extra members, which is the
minimum, about (t_r - t_min)/t_r of the replica's gradient (see ``traffic_lower_bound``).

Initial layouts use contiguous partitions (extras take the partitions' tails). A layout
computed from a previous one is *sticky*: members keep the units they hold where the
constraints allow, so a reshard moves few units (e.g. 8 -> 7 moves only the departing
member's units).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tpflex_trainer.ntp.errors import LayoutError


class Derived(NamedTuple):
    """A family whose units follow another family's: unit g of the derived family is
    held by every member holding any of the source units ``g * per_unit ..
    (g + 1) * per_unit - 1`` (a KV head is held by every member holding one of its query
    heads: a *replicated unit* when the TP degree exceeds the KV groups)."""

    source: str
    per_unit: int


class Member(NamedTuple):
    """One process slot of the job: replica index, base-TP slot (GPU) in its domain, and
    the pipeline stage whose domain that is (0 without pipeline parallelism; last so that
    ``Member(replica, slot)`` keeps meaning what it meant before stages)."""

    replica: int
    slot: int
    stage: int = 0


@dataclass(frozen=True)
class ReplicaPlacement:
    """What a plan says about one stage of one replica: the slots it uses and the
    replica's local batch (the same on every stage of the replica)."""

    replica: int
    slots: tuple[int, ...]
    local_batch: int = 1
    stage: int = 0

    @property
    def degree(self) -> int:
        return len(self.slots)


@dataclass(frozen=True)
class MemberLayout:
    member: Member
    tp_rank: int
    core: bool
    units: Mapping[str, tuple[int, ...]]  # family -> sorted unit ids


@dataclass(frozen=True)
class ReplicaLayout:
    replica: int
    local_batch: int
    members: tuple[MemberLayout, ...]  # TP-rank order; the first t_min are core

    @property
    def degree(self) -> int:
        return len(self.members)


@dataclass(frozen=True)
class JobLayout:
    base_tp: int
    families: tuple[tuple[str, int], ...]  # (family, unit count), in a fixed order
    t_min: int
    partitions: Mapping[str, tuple[tuple[int, ...], ...]]  # family -> core partitions
    replicas: tuple[ReplicaLayout, ...]
    stage: int = 0  # the pipeline stage this layout places (its own families and degrees)

    def member(self, member: Member) -> MemberLayout | None:
        for rep in self.replicas:
            if rep.replica == member.replica:
                for m in rep.members:
                    if m.member == member:
                        return m
        return None

    def replica(self, replica: int) -> ReplicaLayout:
        for rep in self.replicas:
            if rep.replica == replica:
                return rep
        raise KeyError(replica)

    def members(self) -> list[MemberLayout]:
        return [m for rep in self.replicas for m in rep.members]

    @property
    def global_batch(self) -> int:
        return sum(rep.local_batch for rep in self.replicas)

    def partition_of(self, family: str) -> dict[int, int]:
        """unit -> core partition index."""
        return {u: p for p, part in enumerate(self.partitions[family]) for u in part}

    def placements(self) -> tuple[ReplicaPlacement, ...]:
        return tuple(
            ReplicaPlacement(rep.replica, tuple(m.member.slot for m in rep.members), rep.local_batch, self.stage)
            for rep in self.replicas
        )


# ---------------------------------------------------------------------------- sizes


def balanced_sizes(n: int, t: int) -> list[int]:
    """Shard sizes of n units on t ranks, as even as possible (larger ones first)."""
    return [n // t + (1 if i < n % t else 0) for i in range(t)]


def traffic_lower_bound(n: int, degree: int, partition_sizes: Sequence[int]) -> int:
    """Fewest units a replica at ``degree`` must move to its core ranks for gradient sync,
    over all balanced layouts whose core rank p holds a subset of partition p: the cores
    keep as much as they can, the larger shard sizes going to the larger partitions."""
    t_min = len(partition_sizes)
    sizes = sorted(balanced_sizes(n, degree), reverse=True)
    parts = sorted(partition_sizes, reverse=True)
    kept = sum(min(parts[p], sizes[p]) for p in range(t_min))
    return n - kept


def replica_traffic(layout: JobLayout, replica: int) -> dict[str, int]:
    """Units per family that gradient sync moves to a reducer inside the replica (and back):
    every (member, unit) whose member is not the core member of the unit's partition. For
    placed families these are the extra ranks' units; for a derived family every copy of
    a replicated unit held outside its reducer counts."""
    rep = layout.replica(replica)
    out = {}
    for fam, _ in layout.families:
        part = layout.partition_of(fam)
        out[fam] = sum(
            1 for m in rep.members for u in m.units[fam] if m.tp_rank != part[u]
        )
    return out


# ----------------------------------------------------------------------- validation


def validate_request(
    unit_counts: Mapping[str, int], placements: Sequence[ReplicaPlacement], base_tp: int
) -> tuple[tuple[str, int], ...]:
    """Raise ``LayoutError`` naming the failed constraint; return the family order."""
    if base_tp < 1:
        raise LayoutError(f"base_tp must be >= 1, got {base_tp}", code="degree_zero")
    if not placements:
        raise LayoutError("a layout needs at least one replica", code="no_replicas")
    families = tuple((str(f), int(n)) for f, n in unit_counts.items())
    for fam, n in families:
        if n < 1:
            raise LayoutError(f"family {fam!r} has {n} units; needs >= 1", code="more_ranks_than_units")
    stages = {p.stage for p in placements}
    if len(stages) != 1:
        raise LayoutError(f"one layout places one stage; got stages {sorted(stages)}", code="mixed_stages")
    seen: set[int] = set()
    for p in placements:
        _validate_placement(p, families, base_tp, seen)
    return families


def _validate_placement(
    p: ReplicaPlacement, families: tuple[tuple[str, int], ...], base_tp: int, seen: set[int]
) -> None:
    if p.replica in seen:
        raise LayoutError(f"replica {p.replica} is listed twice", code="duplicate_replica")
    seen.add(p.replica)
    if p.degree == 0:
        raise LayoutError(f"replica {p.replica} has TP degree 0", code="degree_zero")
    if p.degree > base_tp:
        raise LayoutError(
            f"replica {p.replica} has TP degree {p.degree} above the domain size {base_tp}",
            code="degree_above_domain",
        )
    if len(set(p.slots)) != p.degree:
        raise LayoutError(f"replica {p.replica} uses a slot twice: {p.slots}", code="duplicate_slot")
    bad = [s for s in p.slots if not 0 <= s < base_tp]
    if bad:
        raise LayoutError(
            f"replica {p.replica} uses slots {bad} outside 0..{base_tp - 1}", code="slot_out_of_range"
        )
    for fam, n in families:
        if p.degree > n:
            raise LayoutError(
                f"replica {p.replica} has {p.degree} ranks but family {fam!r} has only {n} units",
                code="more_ranks_than_units",
            )
    if p.local_batch < 1:
        raise LayoutError(
            f"replica {p.replica} has local batch {p.local_batch}; needs >= 1", code="bad_local_batch"
        )


def check_partners(pairs: Iterable[tuple[str, int, str, int]]) -> None:
    """Each (column name, its unit count, row name, its unit count) must agree: a
    column-parallel weight and its row-parallel partner always hold the same units."""
    for col, col_units, row, row_units in pairs:
        if col_units != row_units:
            raise LayoutError(
                f"paired weights {col!r} ({col_units} units) and {row!r} ({row_units} units) "
                "have different unit counts",
                code="partner_unit_mismatch",
            )


# ------------------------------------------------------------------------- planning

Held = Mapping[Member, Mapping[str, frozenset[int]]]


def plan_layout(
    unit_counts: Mapping[str, int],
    placements: Sequence[ReplicaPlacement],
    base_tp: int,
    previous: JobLayout | None = None,
    holders: Iterable[Member] | None = None,
    derived: Mapping[str, Derived] | None = None,
) -> JobLayout:
    """The layout for ``placements``. With ``previous`` (and ``holders``, the members whose
    state survived; default all of ``previous``) members keep what they hold where possible.
    ``derived`` families are added from their source family (``with_derived``)."""
    families = validate_request(unit_counts, placements, base_tp)
    held = _held_units(previous, holders)
    prev_rank = {m.member: m.tp_rank for m in previous.members()} if previous else {}
    t_min = min(p.degree for p in placements)
    anchor = _pick_anchor(placements, t_min, held)
    anchor_members = _ordered_members(anchor, prev_rank)
    partitions: dict[str, tuple[tuple[int, ...], ...]] = {}
    for fam, n in families:
        holdings = [held.get(m, {}).get(fam, frozenset()) for m in anchor_members]
        partitions[fam] = tuple(_sticky_fill(range(n), balanced_sizes(n, t_min), holdings))
    replicas = []
    for p in sorted(placements, key=lambda x: x.replica):
        members = _ordered_members(p, prev_rank)
        if p is anchor:
            cores, extras = anchor_members, []
        else:
            cores, extras = _match_cores(members, partitions, held)
        replicas.append(_replica_layout(p, cores, extras, families, partitions, held))
    layout = JobLayout(base_tp, families, t_min, partitions, tuple(replicas), placements[0].stage)
    return with_derived(layout, derived or {})


def derived_units(source_units: Iterable[int], per_unit: int) -> tuple[int, ...]:
    return tuple(sorted({u // per_unit for u in source_units}))


def with_derived(layout: JobLayout, derived: Mapping[str, Derived]) -> JobLayout:
    """Add each derived family: a member holds the derived units of its source units; the
    derived unit g belongs to the core partition of its first source unit, so a replica at
    t_min reduces it on a member that holds it."""
    if not derived:
        return layout
    counts = dict(layout.families)
    families = list(layout.families)
    partitions = dict(layout.partitions)
    for fam, d in derived.items():
        n = -(-counts[d.source] // d.per_unit)
        families.append((fam, n))
        src_part = layout.partition_of(d.source)
        partitions[fam] = tuple(
            tuple(g for g in range(n) if src_part[g * d.per_unit] == p) for p in range(layout.t_min)
        )
    replicas = tuple(
        ReplicaLayout(rep.replica, rep.local_batch, tuple(
            MemberLayout(m.member, m.tp_rank, m.core, {
                **dict(m.units),
                **{fam: derived_units(m.units[d.source], d.per_unit) for fam, d in derived.items()},
            })
            for m in rep.members
        ))
        for rep in layout.replicas
    )
    return JobLayout(layout.base_tp, tuple(families), layout.t_min, partitions, replicas, layout.stage)


def _held_units(previous: JobLayout | None, holders: Iterable[Member] | None) -> Held:
    if previous is None:
        return {}
    alive = None if holders is None else {Member(*h) for h in holders}
    return {
        m.member: {f: frozenset(u) for f, u in m.units.items()}
        for m in previous.members()
        if alive is None or m.member in alive
    }


def _held_total(p: ReplicaPlacement, held: Held) -> int:
    return sum(len(u) for s in p.slots for u in held.get(Member(p.replica, s, p.stage), {}).values())


def _pick_anchor(placements: Sequence[ReplicaPlacement], t_min: int, held: Held) -> ReplicaPlacement:
    """The replica at t_min that defines the partitions: the one holding the most state."""
    smallest = [p for p in placements if p.degree == t_min]
    return min(smallest, key=lambda p: (-_held_total(p, held), p.replica))


def _ordered_members(p: ReplicaPlacement, prev_rank: Mapping[Member, int]) -> list[Member]:
    members = [Member(p.replica, s, p.stage) for s in p.slots]
    return sorted(members, key=lambda m: (prev_rank.get(m, len(members) + 1_000), p.slots.index(m.slot)))


def _sticky_fill(
    universe: Iterable[int], sizes: Sequence[int], holdings: Sequence[frozenset[int]]
) -> list[tuple[int, ...]]:
    """Split ``universe`` into shards with the multiset ``sizes``; shard i keeps as much of
    holdings[i] as it can (larger sizes go to larger holdings; a unit held twice, e.g.
    after an interrupted reshard, is kept once), the rest fills in order."""
    universe = list(universe)
    allowed = set(universe)
    order = sorted(range(len(holdings)), key=lambda i: (-len(holdings[i] & allowed), i))
    size_of = dict(zip(order, sorted(sizes, reverse=True), strict=True))
    keep: list[list[int]] = [[] for _ in holdings]
    taken: set[int] = set()
    for i in order:
        keep[i] = [u for u in sorted(holdings[i] & allowed) if u not in taken][: size_of[i]]
        taken.update(keep[i])
    pool = [u for u in universe if u not in taken]
    shards = []
    for i, k in enumerate(keep):
        need = size_of[i] - len(k)
        shards.append(tuple(sorted(k + pool[:need])))
        pool = pool[need:]
    return shards


def _match_cores(
    members: list[Member], partitions: Mapping[str, tuple[tuple[int, ...], ...]], held: Held
) -> tuple[list[Member], list[Member]]:
    """Give each core partition the member whose held units overlap it most (greedy on
    the non-zero overlaps, then the remaining partitions in order)."""
    t_min = len(next(iter(partitions.values())))
    part_of = {f: {u: p for p, part in enumerate(parts) for u in part} for f, parts in partitions.items()}
    weight: dict[tuple[int, int], int] = {}
    for i, m in enumerate(members):
        for f, units in held.get(m, {}).items():
            for u in units:
                p = part_of.get(f, {}).get(u)
                if p is not None:
                    weight[(p, i)] = weight.get((p, i), 0) + 1
    cores: list[Member | None] = [None] * t_min
    used: set[int] = set()
    for (p, i), _ in sorted(weight.items(), key=lambda kv: (-kv[1], kv[0])):
        if cores[p] is None and i not in used:
            cores[p] = members[i]
            used.add(i)
    free = (i for i in range(len(members)) if i not in used)  # lazy: skips later picks too
    for p in range(t_min):
        if cores[p] is None:
            i = next(free)
            cores[p] = members[i]
            used.add(i)
    extras = [m for i, m in enumerate(members) if i not in used]
    return [c for c in cores if c is not None], extras


def _replica_layout(
    p: ReplicaPlacement,
    cores: list[Member],
    extras: list[Member],
    families: tuple[tuple[str, int], ...],
    partitions: Mapping[str, tuple[tuple[int, ...], ...]],
    held: Held,
) -> ReplicaLayout:
    units: dict[Member, dict[str, tuple[int, ...]]] = {m: {} for m in cores + extras}
    for fam, n in families:
        shards = _replica_family(n, cores, extras, partitions[fam], fam, held)
        for m, shard in zip(cores + extras, shards, strict=True):
            units[m][fam] = shard
    t_min = len(cores)
    members = tuple(
        MemberLayout(m, rank, rank < t_min, units[m]) for rank, m in enumerate(cores + extras)
    )
    return ReplicaLayout(p.replica, p.local_batch, members)


def _replica_family(
    n: int,
    cores: list[Member],
    extras: list[Member],
    parts: tuple[tuple[int, ...], ...],
    fam: str,
    held: Held,
) -> list[tuple[int, ...]]:
    degree = len(cores) + len(extras)
    small, n_big = n // degree, n % degree
    eligible = sorted((p for p in range(len(cores)) if len(parts[p]) > small), key=lambda p: (-len(parts[p]), p))
    big_cores = set(eligible[:n_big])
    core_sizes = [min(len(parts[p]), small + (1 if p in big_cores else 0)) for p in range(len(cores))]
    extra_sizes = [small + 1] * (n_big - len(big_cores)) + [small] * (len(extras) - n_big + len(big_cores))
    if len(extra_sizes) != len(extras) or sum(core_sizes) + sum(extra_sizes) != n:
        raise AssertionError(f"unbalanced layout n={n} degree={degree} parts={parts}")
    extra_held = {u for m in extras for u in held.get(m, {}).get(fam, frozenset())}
    shards: list[tuple[int, ...]] = []
    for p, m in enumerate(cores):
        mine = held.get(m, {}).get(fam, frozenset()) & set(parts[p])
        rest = sorted(set(parts[p]) - mine, key=lambda u: (u in extra_held, u))
        keep = sorted(mine)[: core_sizes[p]]
        shards.append(tuple(sorted(keep + rest[: core_sizes[p] - len(keep)])))
    remainder = sorted(set(range(n)) - {u for s in shards for u in s})
    holdings = [held.get(m, {}).get(fam, frozenset()) for m in extras]
    shards += _sticky_fill(remainder, extra_sizes, holdings)
    return shards
