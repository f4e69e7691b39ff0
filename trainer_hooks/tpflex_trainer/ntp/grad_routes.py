"""Where each gradient block of a bucket goes during gradient sync (index bookkeeping,
no collectives).

Every (member, unit) of a replica has a *reducer*: the core member (TP rank p < t_min) of
the unit's core partition p. A member sends the gradient blocks of the units it holds
but does not reduce to their reducers (pre-sync move), the reducer adds them to its own
(a replicated KV unit has several holders: their partial gradients are summed exactly
once, at the reducer), all-reduces its partition across replicas, and sends the result
back to every member that sent a block (post-sync move). Blocks are ordered param-major,
then by unit, grouped by the peer's rank in the replica's gradient TP group, so sender and
receiver agree on the order without exchanging it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tpflex_trainer.ntp.config import ParamSpec
from tpflex_trainer.ntp.layout import JobLayout, Member, MemberLayout

Block = tuple[int, int]  # (offset, numel)


@dataclass
class Routes:
    send_idx: torch.Tensor  # flat positions of the blocks this member sends, in send order
    send_splits: list[int]  # per group rank: elements sent (pre) / received back (post)
    recv_splits: list[int]  # per group rank: elements received (pre) / sent back (post)
    own_idx: torch.Tensor  # flat positions of blocks this member reduces itself ...
    own_core_idx: torch.Tensor  # ... and their positions in the core buffer
    recv_core_idx: torch.Tensor  # core-buffer positions of the received blocks
    core_numel: int  # size of this member's core buffer (0 when not a core member)
    count_idx: torch.Tensor | None  # flat positions counted in the global grad norm (None: all)


def _ranges(pieces: list[Block], device: torch.device) -> torch.Tensor:
    if not pieces:
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.cat([torch.arange(s, s + n, dtype=torch.long) for s, n in pieces]).to(device)


def replica_moves(layout: JobLayout, replica: int) -> bool:
    """Whether any member of the replica holds a unit reduced by another member (the same
    answer on every member of the replica)."""
    parts = {f: layout.partition_of(f) for f, _ in layout.families}
    rep = layout.replica(replica)
    return any(m.tp_rank != parts[f][u] for m in rep.members for f, us in m.units.items()
               if f in parts for u in us)


def bucket_routes(
    params: list[ParamSpec],
    layout: JobLayout,
    mine: MemberLayout,
    group_rank: Mapping[Member, int] | None,
    counted_replica: bool,
    device: torch.device,
) -> Routes:
    """``group_rank`` maps the replica's members to their gradient-group ranks (None when
    the replica moves nothing); ``counted_replica``: this replica counts the grad norm."""
    rep = layout.replica(mine.member.replica)
    parts = {f: layout.partition_of(f) for f, _ in layout.families}
    size = rep.degree
    by_rank = sorted(rep.members, key=lambda m: group_rank[m.member]) if group_rank else []
    core_pos: dict[tuple[str, int], int] = {}
    core_numel = 0
    if mine.core:
        for spec in params:
            for u in layout.partitions[spec.family][mine.tp_rank]:
                core_pos[(spec.name, u)] = core_numel
                core_numel += spec.unit_numel
    own, own_core, counted = [], [], []
    sends: dict[int, list[Block]] = {}
    offset = 0
    for spec in params:
        for pos, u in enumerate(mine.units[spec.family]):
            block = (offset + pos * spec.unit_numel, spec.unit_numel)
            reducer = parts[spec.family][u]
            if reducer == mine.tp_rank:
                own.append(block)
                own_core.append((core_pos[(spec.name, u)], spec.unit_numel))
            else:
                sends.setdefault(reducer, []).append(block)
            if counted_replica and _first_holder(rep.members, spec.family, u) == mine.tp_rank:
                counted.append(block)
        offset += spec.unit_numel * len(mine.units[spec.family])
    send_splits, recv_splits = [0] * size, [0] * size
    send_blocks: list[Block] = []
    recv_blocks: list[Block] = []
    for peer in by_rank:
        blocks = sends.get(peer.tp_rank, [])
        send_blocks += blocks
        send_splits[group_rank[peer.member]] = sum(n for _, n in blocks)
        if mine.core and peer.member != mine.member:
            got = [(core_pos[(s.name, u)], s.unit_numel) for s in params
                   for u in peer.units[s.family] if parts[s.family][u] == mine.tp_rank]
            recv_blocks += got
            recv_splits[group_rank[peer.member]] = sum(n for _, n in got)
    all_counted = counted_replica and len(counted) == sum(1 for s in params for _ in mine.units[s.family])
    return Routes(
        send_idx=_ranges(send_blocks, device), send_splits=send_splits, recv_splits=recv_splits,
        own_idx=_ranges(own, device), own_core_idx=_ranges(own_core, device),
        recv_core_idx=_ranges(recv_blocks, device), core_numel=core_numel,
        count_idx=None if all_counted else _ranges(counted, device),
    )


def _first_holder(members, family: str, unit: int) -> int:
    return min(m.tp_rank for m in members if unit in m.units[family])
