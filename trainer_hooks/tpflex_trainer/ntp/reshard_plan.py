"""Which units move where when the layout changes: pure, no torch.

A member that already holds a unit keeps it. Every other (member, unit) of the new layout
gets exactly one transfer from a live holder: the same replica when it still holds the
unit, otherwise another replica (peer recovery: replicas hold bit-identical weights and
Adam state after every step). Units with no live holder are ``missing``: the caller falls
back to the checkpoint. Bytes moved therefore equal the lower bound: one copy of each
unit a member needs and does not hold.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tpflex_trainer.ntp.config import REPLICATED
from tpflex_trainer.ntp.layout import JobLayout, Member


@dataclass(frozen=True)
class Transfer:
    src: Member
    dst: Member
    family: str  # a unit family or REPLICATED (unit 0: every replicated parameter)
    unit: int

    @property
    def peer(self) -> bool:
        return self.src.replica != self.dst.replica


@dataclass(frozen=True)
class ReshardPlan:
    transfers: tuple[Transfer, ...]
    kept: int  # (member, unit) pairs that stay put
    missing: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def bytes_moved(self, unit_bytes: Mapping[str, int]) -> int:
        return sum(unit_bytes[t.family] for t in self.transfers)

    def peer_units(self) -> int:
        return sum(1 for t in self.transfers if t.peer)


def holdings(layout: JobLayout | None, holders: Iterable[Member]) -> dict[Member, dict[str, frozenset[int]]]:
    """What each live member holds now (``layout`` restricted to ``holders``), replicated
    pseudo-unit included."""
    if layout is None:
        return {}
    alive = {Member(*h) for h in holders}
    return {
        m.member: {**{f: frozenset(u) for f, u in m.units.items()}, REPLICATED: frozenset({0})}
        for m in layout.members()
        if m.member in alive
    }


def needed_units(new: JobLayout) -> dict[Member, dict[str, tuple[int, ...]]]:
    return {m.member: {**dict(m.units), REPLICATED: (0,)} for m in new.members()}


def plan_reshard(old: JobLayout | None, new: JobLayout, holders: Iterable[Member]) -> ReshardPlan:
    held = holdings(old, holders)
    owners: dict[tuple[str, int], list[Member]] = {}
    for member in sorted(held):
        for fam, units in held[member].items():
            for u in units:
                owners.setdefault((fam, u), []).append(member)
    load: dict[Member, int] = {m: 0 for m in held}
    transfers: list[Transfer] = []
    missing: dict[str, list[int]] = {}
    kept = 0
    for dst, fams in sorted(needed_units(new).items()):
        for fam, units in fams.items():
            for u in units:
                if u in held.get(dst, {}).get(fam, frozenset()):
                    kept += 1
                    continue
                src = _pick_source(owners.get((fam, u), []), dst, load)
                if src is None:
                    missing.setdefault(fam, []).append(u)
                    continue
                load[src] += 1
                transfers.append(Transfer(src, dst, fam, u))
    frozen_missing = {f: tuple(sorted(set(us))) for f, us in missing.items()}
    return ReshardPlan(tuple(transfers), kept, frozen_missing)


def _pick_source(candidates: list[Member], dst: Member, load: Mapping[Member, int]) -> Member | None:
    """Prefer the destination's own replica, then the least-loaded holder."""
    if not candidates:
        return None
    return min(candidates, key=lambda m: (m.replica != dst.replica, load[m], m))


def lower_bound_units(old: JobLayout | None, new: JobLayout, holders: Iterable[Member]) -> dict[str, int]:
    """Per family, the (member, unit) pairs of ``new`` whose member does not hold the unit:
    no reshard can move fewer units than this."""
    held = holdings(old, holders)
    out: dict[str, int] = {}
    for member, fams in needed_units(new).items():
        for fam, units in fams.items():
            have = held.get(member, {}).get(fam, frozenset())
            out[fam] = out.get(fam, 0) + sum(1 for u in units if u not in have)
    return out
