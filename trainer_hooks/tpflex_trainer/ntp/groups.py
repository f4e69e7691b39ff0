"""Process groups of one layout: per replica its TP group (model collectives) and a second
TP group for gradient moves, one core group per core index across replicas, and the group
of all active members. ``GroupCache.build`` is collective over the default group: every
process calls it with the same layout. Groups whose members did not change are reused
(while the default group is the same), single-member groups are not created."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tpflex_trainer.ntp.errors import PlanError
from tpflex_trainer.ntp.layout import JobLayout, Member, ReplicaPlacement

GroupKey = tuple[str, tuple[int, ...]]  # (purpose, sorted ranks)

# How long forming a group may take. Every process arrives within moments of the others
# (right after a collective over the default group), but gloo's connectFullMesh waits for a
# peer that published its address and then never connects (it failed its own connect, or
# froze) five times this long, and nothing else ends that wait: with the 60 s collective
# timeout it was 300 s, past the rank-liveness bound of the peers waiting for this rank.
# The group gets the collective timeout once it is formed.
FORMATION_TIMEOUT = timedelta(seconds=5)


def new_group(ranks: list[int], timeout: timedelta) -> dist.ProcessGroup | None:
    """``dist.new_group`` formed under :data:`FORMATION_TIMEOUT` (or ``timeout`` if shorter),
    its collectives under ``timeout``. Collective over the default group; None for a
    process that is not in ``ranks``."""
    group = dist.new_group(ranks=ranks, timeout=min(timeout, FORMATION_TIMEOUT))
    if group == dist.GroupMember.NON_GROUP_MEMBER or group is None:
        return None
    set_collective_timeout(group, timeout)
    return group


def set_collective_timeout(group: dist.ProcessGroup | None, timeout: timedelta) -> None:
    """A formed group's collectives time out after ``timeout`` (None: the default group)."""
    dist.distributed_c10d._set_pg_timeout(timeout, group)


@dataclass
class NtpGroups:
    """The groups this member uses (None: not a member, or a single-member group)."""

    tp: dist.ProcessGroup | None = None
    tp_grad: dist.ProcessGroup | None = None
    core: dist.ProcessGroup | None = None
    active: dist.ProcessGroup | None = None


def device_for_backend() -> torch.device:
    """cuda for nccl (the current device), cpu for gloo: the same code runs on both."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_world(
    placements: tuple[ReplicaPlacement, ...],
    world: Mapping[Member, int],
    me: Member,
    world_size: int,
    my_rank: int,
) -> None:
    """Raise ``PlanError`` (before any collective) if the world map does not fit."""
    ranks = list(world.values())
    if len(set(ranks)) != len(ranks):
        raise PlanError(f"world map gives one rank to several members: {dict(world)}")
    if any(not 0 <= r < world_size for r in ranks) or len(ranks) != world_size:
        raise PlanError(f"world map must give each of the {world_size} ranks to one member: {dict(world)}")
    if world.get(me) != my_rank:
        raise PlanError(f"member {tuple(me)} is rank {my_rank} but the world map says {world.get(me)}")
    for p in placements:
        for s in p.slots:
            if Member(p.replica, s, p.stage) not in world:
                raise PlanError(f"member {tuple(Member(p.replica, s, p.stage))} of the plan is not in the world map")


def _stages(layouts: JobLayout | Sequence[JobLayout]) -> tuple[JobLayout, ...]:
    return (layouts,) if isinstance(layouts, JobLayout) else tuple(layouts)


def wanted_groups(layouts: JobLayout | Sequence[JobLayout], world: Mapping[Member, int]) -> list[GroupKey]:
    """Every multi-member group of the stages' layouts, in the order all processes create
    them: per stage and replica its TP groups, per stage its core groups across replicas,
    and one group of every active member of every stage (global gradient norm and loss).
    A single one-stage replica needs no core or active group."""
    stages = _stages(layouts)
    keys: list[GroupKey] = []
    for layout in stages:
        for rep in layout.replicas:
            ranks = tuple(sorted(world[m.member] for m in rep.members))
            keys.append(("tp", ranks))
            keys.append(("tp_grad", ranks))  # gradient moves (extras, replicated KV units)
        if len(layout.replicas) > 1:
            for p in range(layout.t_min):
                keys.append(("core", tuple(sorted(world[rep.members[p].member] for rep in layout.replicas))))
    if len(stages) > 1 or len(stages[0].replicas) > 1:
        keys.append(("active", _active_ranks(stages, world)))
    return [k for k in keys if len(k[1]) > 1]


def _active_ranks(stages: Sequence[JobLayout], world: Mapping[Member, int]) -> tuple[int, ...]:
    return tuple(sorted(world[m.member] for layout in stages for m in layout.members()))


class GroupCache:
    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self.groups: dict[GroupKey, dist.ProcessGroup | None] = {}
        self.world_group: object = None

    def intact(self) -> bool:
        """Whether this process still holds the groups it built under the current default
        group (reuse is only safe when every process does)."""
        return self.world_group is dist.group.WORLD

    def build(self, layouts: JobLayout | Sequence[JobLayout], world: Mapping[Member, int], me: Member) -> NtpGroups:
        if self.world_group is not dist.group.WORLD:
            self.forget()  # the default group was re-initialised: old groups are gone
            self.world_group = dist.group.WORLD
        wanted = wanted_groups(layouts, world)
        for key in [k for k in self.groups if k not in wanted]:
            self._destroy(self.groups.pop(key))
        for key in wanted:
            if key not in self.groups:
                self.groups[key] = new_group(list(key[1]), self.timeout)
        return self._mine(_stages(layouts), world, me)

    def _mine(self, stages: tuple[JobLayout, ...], world: Mapping[Member, int], me: Member) -> NtpGroups:
        out = NtpGroups()
        layout = next((lay for lay in stages if lay.stage == me.stage), None)
        mine = layout.member(me) if layout is not None else None
        if mine is None:
            return out
        rep = layout.replica(me.replica)
        tp_ranks = tuple(sorted(world[m.member] for m in rep.members))
        out.tp = self.groups.get(("tp", tp_ranks))
        out.tp_grad = self.groups.get(("tp_grad", tp_ranks))
        if mine.core:
            core = tuple(sorted(world[r.members[mine.tp_rank].member] for r in layout.replicas))
            out.core = self.groups.get(("core", core))
        out.active = self.groups.get(("active", _active_ranks(stages, world)))
        return out

    @staticmethod
    def _destroy(group: dist.ProcessGroup | None) -> None:
        if group is not None:
            dist.destroy_process_group(group)

    def forget(self) -> None:
        """Drop every group without destroying it (its default group is already gone)."""
        self.groups.clear()

    def abandon(self) -> None:
        """After a failure: destroy what can be destroyed and drop every reference, so that
        gloo closes the connections and peers blocked in these groups fail at once."""
        for group in self.groups.values():
            if group is None:
                continue
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError):
                pass  # already gone with the default group, or broken: dropping it is enough
        self.groups.clear()
        self.world_group = None

    def close(self) -> None:
        if self.world_group is dist.group.WORLD and dist.is_initialized():
            for group in self.groups.values():
                self._destroy(group)
        self.groups.clear()
        self.world_group = None
