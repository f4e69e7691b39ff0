"""DDP-like, bucketed gradient sync across replicas with different TP degrees.

Per bucket of sharded parameters, as soon as autograd has produced all its gradients:
1. pre-sync move (only in replicas with extra members): extras send their units' gradients
   to the core member owning each unit's partition (``all_to_all_single`` in the TP group,
   async, overlapping the rest of backward);
2. core member p of every replica all-reduces partition p's gradients, one-to-one across
   replicas, in one contiguous buffer (async, launched in bucket order as moves finish);
3. post-sync move: the reduced values of the extras' units go back (async, overlapping
   the all-reduces of the remaining buckets).
Replicated parameters (layer norms, positions) and the loss are all-reduced by the core
members across replicas (they are the same on every TP member) and then sent to the
extras. Gradients are pre-scaled by the replica's share of the global batch
(``local_batch / global_batch``), so the sum is the gradient of the mean loss over the
global batch, whatever the local batches and degrees.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from tpflex_trainer.ntp.collectives import PendingAllReduce
from tpflex_trainer.ntp.config import ParamSpec
from tpflex_trainer.ntp.layout import JobLayout, Member

DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024


@dataclass
class _Bucket:
    params: list[tuple[ParamSpec, nn.Parameter]]
    flat: torch.Tensor
    send_idx: torch.Tensor | None = None  # extra: positions in flat, in send order
    splits: list[int] | None = None  # per TP-group rank: extra sends / core receives
    f_idx: torch.Tensor | None = None  # core with extras: local positions ...
    c_local_idx: torch.Tensor | None = None  # ... and where they go in the core buffer
    c_recv_idx: torch.Tensor | None = None  # core buffer positions of received units
    core_numel: int = 0
    ready: int = 0
    pre: object = None
    recv: torch.Tensor | None = None
    core_buf: torch.Tensor | None = None
    reduce: object = None
    post: object = None
    post_out: torch.Tensor | None = None
    pre_bytes: int = field(default=0)


def _ranges(pieces: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    if not pieces:
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.cat([torch.arange(s, s + n, dtype=torch.long) for s, n in pieces]).to(device)


class GradSync:
    """Registers autograd hooks on ``model``'s parameters. Per step: ``begin(weight)``
    before backward, ``finish(loss)`` after it (returns the global mean loss)."""

    def __init__(
        self,
        params: list[tuple[ParamSpec, nn.Parameter]],
        layout: JobLayout,
        me: Member,
        world: Mapping[Member, int],
        groups,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        mine = layout.member(me)
        assert mine is not None, "only active members sync gradients"
        self.layout, self.mine, self.groups = layout, mine, groups
        self.rep = layout.replica(me.replica)
        self.multi = len(layout.replicas) > 1
        self.has_extras = self.rep.degree > layout.t_min
        self.device = params[0][1].device
        self.weight = 1.0
        sharded = [(s, p) for s, p in params if s.sharded]
        replicated = [(s, p) for s, p in params if not s.sharded]
        self.buckets = [self._make_bucket(b, world) for b in _split_buckets(sharded, bucket_bytes)]
        self.repl = _Bucket(replicated, self._flat_for(replicated, extra=1))
        self.bucket_of: dict[nn.Parameter, _Bucket] = {}
        for b in [*self.buckets, self.repl]:
            for _, p in b.params:
                self.bucket_of[p] = b
        self.repl_peers = self._replicated_peers(world)
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in params]
        self.next_pre = 0
        self.next_reduce = 0
        self.finish_seconds = 0.0  # time the last step spent in finish() (not overlapped)
        self.reduced_in_backward = 0  # buckets of the last step whose all-reduce started in backward
        self.sent_bytes = 0  # pre-sync bytes this member handed to the TP group, cumulative

    # ------------------------------------------------------------------ construction
    def _flat_for(self, params: list[tuple[ParamSpec, nn.Parameter]], extra: int = 0) -> torch.Tensor:
        numel = sum(p.numel() for _, p in params)
        flat = torch.zeros(numel + extra, dtype=torch.float32, device=self.device)
        offset = 0
        for _, p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        return flat

    def _make_bucket(self, params: list[tuple[ParamSpec, nn.Parameter]], world: Mapping[Member, int]) -> _Bucket:
        bucket = _Bucket(params, self._flat_for(params))
        if not (self.multi and self.has_extras):
            return bucket
        group_rank = {m.member: dist.get_group_rank(self.groups.tp_grad, world[m.member]) for m in self.rep.members}
        if self.mine.core:
            self._core_indices(bucket, group_rank)
        else:
            self._extra_indices(bucket, group_rank)
        return bucket

    def _replicated_peers(self, world: Mapping[Member, int]) -> list[int]:
        """TP-group ranks this member sends replicated gradients to (core) or gets them
        from (extra)."""
        if not (self.multi and self.has_extras):
            return []
        t_min = self.layout.t_min
        rank_of = {m.member: dist.get_group_rank(self.groups.tp_grad, world[m.member]) for m in self.rep.members}
        if self.mine.core:
            return [rank_of[m.member] for m in self.rep.members[t_min:] if m.tp_rank % t_min == self.mine.tp_rank]
        return [rank_of[self.rep.members[self.mine.tp_rank % t_min].member]]

    def _unit_blocks(self, params, keep) -> list[tuple[int, int]]:
        """(flat offset, numel) of this member's units passing ``keep``, param-major."""
        out, offset = [], 0
        for spec, p in params:
            for pos, u in enumerate(self.mine.units[spec.family]):
                if keep(spec.family, u):
                    out.append((offset + pos * spec.unit_numel, spec.unit_numel))
            offset += p.numel()
        return out

    def _extra_indices(self, bucket: _Bucket, group_rank: Mapping[Member, int]) -> None:
        part = {f: self.layout.partition_of(f) for f, _ in self.layout.families}
        splits = [0] * self.rep.degree
        pieces: list[tuple[int, int]] = []
        for core in self.rep.members[: self.layout.t_min]:
            mine = self._unit_blocks(bucket.params, lambda f, u, c=core.tp_rank: part[f][u] == c)
            pieces += mine
            splits[group_rank[core.member]] = sum(n for _, n in mine)
        bucket.send_idx, bucket.splits = _ranges(pieces, self.device), splits
        bucket.pre_bytes = 4 * sum(splits)

    def _core_indices(self, bucket: _Bucket, group_rank: Mapping[Member, int]) -> None:
        p_idx = self.mine.tp_rank
        core_pos: dict[tuple[str, int], int] = {}
        offset = 0
        for spec, _ in bucket.params:
            for u in self.layout.partitions[spec.family][p_idx]:
                core_pos[(spec.name, u)] = offset
                offset += spec.unit_numel
        bucket.core_numel = offset
        local, c_local = [], []
        flat_off = 0
        for spec, p in bucket.params:
            for pos, u in enumerate(self.mine.units[spec.family]):
                local.append((flat_off + pos * spec.unit_numel, spec.unit_numel))
                c_local.append((core_pos[(spec.name, u)], spec.unit_numel))
            flat_off += p.numel()
        splits = [0] * self.rep.degree
        c_recv: list[tuple[int, int]] = []
        for extra in sorted(self.rep.members[self.layout.t_min :], key=lambda m: group_rank[m.member]):
            count = 0
            for spec, _ in bucket.params:
                part = set(self.layout.partitions[spec.family][p_idx])
                for u in extra.units[spec.family]:
                    if u in part:
                        c_recv.append((core_pos[(spec.name, u)], spec.unit_numel))
                        count += spec.unit_numel
            splits[group_rank[extra.member]] = count
        bucket.f_idx, bucket.c_local_idx = _ranges(local, self.device), _ranges(c_local, self.device)
        bucket.c_recv_idx, bucket.splits = _ranges(c_recv, self.device), splits

    # ------------------------------------------------------------------------ step
    def begin(self, weight: float) -> None:
        """Zero the gradient buffers; ``weight`` = local batch / global batch."""
        self.weight = weight
        for b in [*self.buckets, self.repl]:
            b.flat.zero_()
            b.ready = 0
            b.pre = b.reduce = b.post = None
        self.next_pre = self.next_reduce = 0
        self.reduced_in_backward = 0

    def _on_grad(self, param: nn.Parameter) -> None:
        bucket = self.bucket_of[param]
        bucket.ready += 1
        if bucket is self.repl:
            return
        while self.next_pre < len(self.buckets) and self._complete(self.buckets[self.next_pre]):
            self._launch_pre(self.buckets[self.next_pre])
            self.next_pre += 1
        self._progress(block=False)

    def _complete(self, b: _Bucket) -> bool:
        return b.ready == len(b.params)

    def _launch_pre(self, b: _Bucket) -> None:
        b.flat.mul_(self.weight)
        if not (self.multi and self.has_extras):
            return
        if self.mine.core:
            b.recv = torch.empty(sum(b.splits), dtype=torch.float32, device=self.device)
            send = torch.empty(0, dtype=torch.float32, device=self.device)
            b.pre = dist.all_to_all_single(b.recv, send, b.splits, [0] * len(b.splits), group=self.groups.tp_grad, async_op=True)
        else:
            send = b.flat.index_select(0, b.send_idx)
            self.sent_bytes += send.numel() * send.element_size()
            b.recv = torch.empty(0, dtype=torch.float32, device=self.device)
            b.pre = dist.all_to_all_single(b.recv, send, [0] * len(b.splits), b.splits, group=self.groups.tp_grad, async_op=True)

    def _progress(self, block: bool) -> None:
        """Launch core all-reduces in bucket order for buckets whose pre-move is done."""
        while self.next_reduce < self.next_pre:
            b = self.buckets[self.next_reduce]
            if b.pre is not None:
                if not block and not b.pre.is_completed():
                    return
                b.pre.wait()
            self._launch_reduce(b)
            self.next_reduce += 1
            if not block:
                self.reduced_in_backward += 1

    def _launch_reduce(self, b: _Bucket) -> None:
        if not self.multi or not self.mine.core:
            return
        if self.has_extras:
            b.core_buf = torch.empty(b.core_numel, dtype=torch.float32, device=self.device)
            b.core_buf.index_copy_(0, b.c_local_idx, b.flat.index_select(0, b.f_idx))
            b.core_buf.index_copy_(0, b.c_recv_idx, b.recv)
        else:
            b.core_buf = b.flat
        if self.groups.core is not None:
            b.reduce = dist.all_reduce(b.core_buf, group=self.groups.core, async_op=True)

    def finish(self, loss: torch.Tensor) -> float:
        """Complete the sync after backward; returns the global mean loss."""
        t0 = time.perf_counter()
        if not all(self._complete(b) for b in [*self.buckets, self.repl]):
            raise RuntimeError("backward did not produce every gradient before finish()")
        while self.next_pre < len(self.buckets):
            self._launch_pre(self.buckets[self.next_pre])
            self.next_pre += 1
        self._progress(block=True)
        # every TP member holds the same replicated gradients (and loss): the core members
        # reduce them across replicas with the last partition, then hand them to extras
        self.repl.flat.mul_(self.weight)
        self.repl.flat[-1] = float(loss) * self.weight
        repl_work = None
        if self.multi and self.mine.core:
            repl_work = PendingAllReduce(self.repl.flat, self.groups.core, dist.ReduceOp.SUM)
        for b in self.buckets:
            self._launch_post(b, repl_work)
        for b in self.buckets:
            if b.post is not None:
                b.post.wait()
                if not self.mine.core:
                    b.flat.index_copy_(0, b.send_idx, self._unpack_post(b))
        if repl_work is not None:
            repl_work.wait()
        self.finish_seconds = time.perf_counter() - t0
        return float(self.repl.flat[-1])

    def _post_splits(self, b: _Bucket) -> list[int]:
        """Per TP-group rank sizes of a bucket's post-sync move. The last bucket's move also
        carries the reduced replicated gradients from core p to the extras e with
        e.tp_rank % t_min == p (``repl_peers``)."""
        if b is not self.buckets[-1]:
            return b.splits
        splits = list(b.splits)
        for rank in self.repl_peers:
            splits[rank] += self.repl.flat.numel()
        return splits

    def _launch_post(self, b: _Bucket, repl_work: PendingAllReduce | None) -> None:
        if b.reduce is not None:
            b.reduce.wait()
        if not (self.multi and self.has_extras):
            return
        zeros = [0] * len(b.splits)
        splits = self._post_splits(b)
        if self.mine.core:
            b.flat.index_copy_(0, b.f_idx, b.core_buf.index_select(0, b.c_local_idx))
            send = b.core_buf.index_select(0, b.c_recv_idx)
            if b is self.buckets[-1]:
                if repl_work is not None:
                    repl_work.wait()
                pieces = []
                for rank, chunk in enumerate(send.split(b.splits)):
                    pieces += [chunk, self.repl.flat] if rank in self.repl_peers else [chunk]
                send = torch.cat(pieces)
            b.post_out = torch.empty(0, dtype=torch.float32, device=self.device)
            b.post = dist.all_to_all_single(b.post_out, send, zeros, splits, group=self.groups.tp_grad, async_op=True)
        else:
            b.post_out = torch.empty(sum(splits), dtype=torch.float32, device=self.device)
            send = torch.empty(0, dtype=torch.float32, device=self.device)
            b.post = dist.all_to_all_single(b.post_out, send, splits, zeros, group=self.groups.tp_grad, async_op=True)

    def _unpack_post(self, b: _Bucket) -> torch.Tensor:
        """An extra's received unit gradients (and, from the last bucket, the replicated
        gradients, copied into place)."""
        if b is not self.buckets[-1]:
            return b.post_out
        units = []
        for rank, part in enumerate(b.post_out.split(self._post_splits(b))):
            units.append(part[: b.splits[rank]])
            if rank in self.repl_peers:
                self.repl.flat.copy_(part[b.splits[rank] :])
        return torch.cat(units)

    def pre_sync_bytes(self) -> int:
        """Bytes this member sends in the pre-sync move per step (extras only)."""
        return sum(b.pre_bytes for b in self.buckets)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _split_buckets(params: list[tuple[ParamSpec, nn.Parameter]], bucket_bytes: int) -> list[list[tuple[ParamSpec, nn.Parameter]]]:
    """Buckets in reverse spec order (≈ backward order), cut by the *full* parameter size
    so that every member of the job cuts at the same places."""
    buckets: list[list[tuple[ParamSpec, nn.Parameter]]] = [[]]
    size = 0
    for spec, p in reversed(params):
        full = 4 * spec.n_units * spec.unit_numel
        if buckets[-1] and size + full > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((spec, p))
        size += full
    return [b for b in buckets if b]
