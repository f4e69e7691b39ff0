"""Carry out a ``ReshardPlan`` over the default process group with batched P2P: each
member sends one buffer per destination (the payloads of the units that destination needs
from it, in plan order) and receives one per source; kept units are copied locally."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from tpflex_trainer.ntp.config import ParamSpec
from tpflex_trainer.ntp.layout import Member
from tpflex_trainer.ntp.reshard_plan import ReshardPlan, Transfer
from tpflex_trainer.ntp.state import LocalState, build_state, payload_numel, unit_payload


def _group_by(transfers: list[Transfer], key) -> dict[Member, list[Transfer]]:
    out: dict[Member, list[Transfer]] = {}
    for t in transfers:
        out.setdefault(key(t), []).append(t)
    return out


def execute_plan(
    plan: ReshardPlan,
    me: Member,
    world: Mapping[Member, int],
    old: LocalState | None,
    new_units: Mapping[str, tuple[int, ...]] | None,
    specs: list[ParamSpec],
    step: int,
    device: torch.device,
) -> tuple[LocalState | None, int]:
    """Returns (this member's new state or None when it holds nothing now, bytes sent)."""
    outgoing = _group_by([t for t in plan.transfers if t.src == me], lambda t: t.dst)
    incoming = _group_by([t for t in plan.transfers if t.dst == me], lambda t: t.src)
    ops, sent = [], 0
    for dst, ts in sorted(outgoing.items()):
        assert old is not None, "a member without state was chosen as a source"
        buf = torch.cat([unit_payload(old, specs, t.family, t.unit) for t in ts])
        sent += buf.numel() * buf.element_size()
        ops.append(dist.P2POp(dist.isend, buf, world[dst]))
    received: dict[tuple[str, int], torch.Tensor] = {}
    for src, ts in sorted(incoming.items()):
        sizes = [payload_numel(specs, t.family) for t in ts]
        buf = torch.empty(sum(sizes), dtype=torch.float32, device=device)
        ops.append(dist.P2POp(dist.irecv, buf, world[src]))
        for t, piece in zip(ts, buf.split(sizes), strict=True):
            received[(t.family, t.unit)] = piece
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    if new_units is None:
        return None, sent

    def fetch(family: str, unit: int) -> torch.Tensor:
        if (family, unit) in received:
            return received[(family, unit)]
        assert old is not None
        return unit_payload(old, specs, family, unit)

    return build_state(specs, new_units, step, device, fetch), sent
