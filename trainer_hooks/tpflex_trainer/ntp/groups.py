"""Process groups of one layout: per replica its TP group (model collectives) and a second
TP group for gradient moves, one core group per core index across replicas, and the group
of all active members. Every process of the default group calls ``build_groups`` with the
same arguments (``new_group`` is collective over the default group)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from tpflex_trainer.ntp.errors import PlanError
from tpflex_trainer.ntp.layout import JobLayout, Member, ReplicaPlacement


@dataclass
class NtpGroups:
    tp: dist.ProcessGroup | None = None
    tp_grad: dist.ProcessGroup | None = None
    core: dist.ProcessGroup | None = None
    active: dist.ProcessGroup | None = None
    created: list[dist.ProcessGroup] = field(default_factory=list)

    def destroy(self) -> None:
        """Destroy the groups; those already gone with a destroyed default group (after
        a member died and the default group was re-initialised) are skipped."""
        for g in self.created:
            try:
                dist.destroy_process_group(g)
            except ValueError:
                pass  # torch: "Invalid process group specified" = already destroyed
        self.created.clear()
        self.tp = self.tp_grad = self.core = self.active = None


def device_for_backend() -> torch.device:
    """cuda for nccl (the current device), cpu for gloo: the same code runs on both."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_world(
    placements: list[ReplicaPlacement] | tuple[ReplicaPlacement, ...],
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
            if Member(p.replica, s) not in world:
                raise PlanError(f"member {(p.replica, s)} of the plan is not in the world map")


def _new_group(ranks: list[int], timeout: timedelta, out: NtpGroups) -> dist.ProcessGroup | None:
    group = dist.new_group(ranks=sorted(ranks), timeout=timeout)
    if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
        out.created.append(group)
        return group
    return None


def build_groups(layout: JobLayout, world: Mapping[Member, int], me: Member, timeout: timedelta) -> NtpGroups:
    out = NtpGroups()
    mine = layout.member(me)
    for rep in layout.replicas:
        ranks = [world[m.member] for m in rep.members]
        tp = _new_group(ranks, timeout, out)
        tp_grad = _new_group(ranks, timeout, out)
        if mine is not None and me.replica == rep.replica and len(ranks) > 1:
            out.tp, out.tp_grad = tp, tp_grad
    for p in range(layout.t_min):
        ranks = [world[rep.members[p].member] for rep in layout.replicas]
        core = _new_group(ranks, timeout, out)
        if mine is not None and mine.core and mine.tp_rank == p and len(ranks) > 1:
            out.core = core
    active = _new_group([world[m.member] for m in layout.members()], timeout, out)
    if mine is not None:
        out.active = active
    return out
