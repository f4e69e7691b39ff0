"""DDP-like, bucketed gradient sync across replicas with different TP degrees.

Per bucket of sharded parameters, as soon as autograd has produced all its gradients
(after the last micro-batch):
1. pre-sync move (only in replicas where some member holds units another member reduces:
   extra ranks, copies of replicated KV units): blocks go to their reducer, the core member
   of the unit's partition (``all_to_all_single`` in the TP group, async, overlapping the
   rest of backward; see ``grad_routes``);
2. core member p of every replica adds what it received to its own blocks and
   all-reduces partition p's gradients, one-to-one across replicas, in one contiguous
   buffer (async, launched in bucket order as moves finish);
3. post-sync move: the reduced values go back to every member that sent a block (async,
   overlapping the all-reduces of the remaining buckets).
Replicated parameters (norms, positions) and the loss are all-reduced by the core members
across replicas (they are the same on every TP member) and then sent to the extras.
Replicated parameters that only see a slice of the activations (``partial_grad``, e.g.
per-head q/k norms) are first summed over the TP group. Gradients are pre-scaled by the
replica's share of the global batch (``local_batch / global_batch``), so the sum is the
gradient of the mean loss over the global batch, whatever the local batches and degrees.
``grad_norm()`` then gives every member the same global 2-norm: each element is counted
once in the job (by the first replica's first holder) and one all-reduce sums the parts.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tpflex_trainer.ntp.collectives import PendingAllReduce, all_reduce
from tpflex_trainer.ntp.config import ParamSpec
from tpflex_trainer.ntp.grad_routes import Routes, bucket_routes, replica_moves
from tpflex_trainer.ntp.layout import JobLayout, Member

DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024


@dataclass
class _Bucket:
    params: list[tuple[ParamSpec, nn.Parameter]]
    flat: torch.Tensor
    routes: Routes | None = None
    ready: int = 0
    pre: object = None
    recv: torch.Tensor | None = None
    core_buf: torch.Tensor | None = None
    reduce: object = None
    post: object = None
    post_out: torch.Tensor | None = None


class GradSync:
    """Registers autograd hooks on ``model``'s parameters. Per step: ``begin(weight,
    micro_batches)`` before the first backward, ``finish(loss)`` after the last one
    (returns the global mean loss)."""

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
        self.moves = replica_moves(layout, me.replica)
        self.device = params[0][1].device
        self.weight = 1.0
        self.micro = 1
        sharded = [(s, p) for s, p in params if s.sharded]
        replicated = [(s, p) for s, p in params if not s.sharded and not s.partial_grad]
        partial = [(s, p) for s, p in params if not s.sharded and s.partial_grad]
        group_rank = None
        if self.moves:
            group_rank = {m.member: dist.get_group_rank(self.groups.tp_grad, world[m.member])
                          for m in self.rep.members}
        counted = layout.replicas[0].replica == me.replica
        self.buckets = []
        for chunk in _split_buckets(sharded, bucket_bytes):
            b = _Bucket(chunk, self._flat_for(chunk))
            b.routes = bucket_routes([s for s, _ in chunk], layout, mine, group_rank, counted, self.device)
            self.buckets.append(b)
        self.repl = _Bucket(replicated + partial, self._flat_for(replicated + partial, extra=1))
        start = sum(p.numel() for _, p in replicated)
        self.partial_slice = slice(start, start + sum(p.numel() for _, p in partial))
        self.repl_counted = counted and mine.tp_rank == 0
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
        # bytes this member handed to its TP group's moves, counted at the send (the tensors
        # given to all_to_all_single): pre-sync and post-sync, cumulative; and both of the last step
        self.sent_bytes = 0
        self.post_sent_bytes = 0
        self.step_sent_bytes = 0

    # ------------------------------------------------------------------ construction
    def _flat_for(self, params: list[tuple[ParamSpec, nn.Parameter]], extra: int = 0) -> torch.Tensor:
        numel = sum(p.numel() for _, p in params)
        flat = torch.zeros(numel + extra, dtype=torch.float32, device=self.device)
        offset = 0
        for _, p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        return flat

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

    # ------------------------------------------------------------------------ step
    def begin(self, weight: float, micro_batches: int = 1) -> None:
        """Zero the gradient buffers; ``weight`` = local batch / global batch; the buckets
        are synced after ``micro_batches`` backward passes."""
        self.weight, self.micro = weight, micro_batches
        for b in [*self.buckets, self.repl]:
            b.flat.zero_()
            b.ready = 0
            b.pre = b.reduce = b.post = None
        self.next_pre = self.next_reduce = 0
        self.reduced_in_backward = 0
        self.step_sent_bytes = 0

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
        return b.ready == len(b.params) * self.micro

    def _launch_pre(self, b: _Bucket) -> None:
        b.flat.mul_(self.weight)
        if not self.moves:
            return
        r = b.routes
        send = b.flat.index_select(0, r.send_idx)
        self.sent_bytes += send.numel() * send.element_size()
        self.step_sent_bytes += send.numel() * send.element_size()
        b.recv = torch.empty(sum(r.recv_splits), dtype=torch.float32, device=self.device)
        b.pre = dist.all_to_all_single(b.recv, send, r.recv_splits, r.send_splits,
                                       group=self.groups.tp_grad, async_op=True)

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
        if not self.mine.core:
            return
        r = b.routes
        if self.moves:
            b.core_buf = torch.zeros(r.core_numel, dtype=torch.float32, device=self.device)
            b.core_buf.index_add_(0, r.own_core_idx, b.flat.index_select(0, r.own_idx))
            b.core_buf.index_add_(0, r.recv_core_idx, b.recv)
        else:
            b.core_buf = b.flat
        if self.multi and self.groups.core is not None:
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
        self.repl.flat.mul_(self.weight)
        self.repl.flat[-1] = float(loss) * self.weight
        if self.groups.tp is not None and self.partial_slice.stop > self.partial_slice.start:
            # per-head norms saw only this member's heads: sum the partial gradients
            all_reduce(self.repl.flat[self.partial_slice], self.groups.tp)
        # every TP member now holds the same replicated gradients (and loss): the core
        # members reduce them across replicas, then hand them to the extras
        repl_work = None
        if self.multi and self.mine.core:
            repl_work = PendingAllReduce(self.repl.flat, self.groups.core, dist.ReduceOp.SUM)
        for b in self.buckets:
            self._launch_post(b, repl_work)
        for b in self.buckets:
            if b.post is not None:
                b.post.wait()
                self._unpack_post(b)
        if repl_work is not None:
            repl_work.wait()
        self.finish_seconds = time.perf_counter() - t0
        return float(self.repl.flat[-1])

    def _post_splits(self, b: _Bucket) -> tuple[list[int], list[int]]:
        """(send, receive) per TP-group rank of a bucket's post-sync move. The last
        bucket's move also carries the reduced replicated gradients from core p to the
        extras e with e.tp_rank % t_min == p (``repl_peers``)."""
        send, recv = list(b.routes.recv_splits), list(b.routes.send_splits)
        if b is self.buckets[-1]:
            for rank in self.repl_peers:
                (send if self.mine.core else recv)[rank] += self.repl.flat.numel()
        return send, recv

    def _launch_post(self, b: _Bucket, repl_work: PendingAllReduce | None) -> None:
        if b.reduce is not None:
            b.reduce.wait()
        if not self.moves:
            return
        r = b.routes
        send_splits, recv_splits = self._post_splits(b)
        send = torch.empty(0, dtype=torch.float32, device=self.device)
        if self.mine.core:
            b.flat.index_copy_(0, r.own_idx, b.core_buf.index_select(0, r.own_core_idx))
            send = b.core_buf.index_select(0, r.recv_core_idx)
            if b is self.buckets[-1] and self.repl_peers:
                if repl_work is not None:
                    repl_work.wait()
                pieces = []
                for rank, chunk in enumerate(send.split(r.recv_splits)):
                    pieces += [chunk, self.repl.flat] if rank in self.repl_peers else [chunk]
                send = torch.cat(pieces)
        self.post_sent_bytes += send.numel() * send.element_size()
        self.step_sent_bytes += send.numel() * send.element_size()
        b.post_out = torch.empty(sum(recv_splits), dtype=torch.float32, device=self.device)
        b.post = dist.all_to_all_single(b.post_out, send, recv_splits, send_splits,
                                        group=self.groups.tp_grad, async_op=True)

    def _unpack_post(self, b: _Bucket) -> None:
        """Copy the reduced blocks this member sent (and, from the last bucket on an extra,
        the replicated gradients) into place."""
        r = b.routes
        if b is self.buckets[-1] and not self.mine.core and self.repl_peers:
            units = []
            for rank, part in enumerate(b.post_out.split(self._post_splits(b)[1])):
                units.append(part[: r.send_splits[rank]])
                if rank in self.repl_peers:
                    self.repl.flat.copy_(part[r.send_splits[rank]:])
            received = torch.cat(units)
        else:
            received = b.post_out
        if received.numel():
            b.flat.index_copy_(0, r.send_idx, received)

    # ------------------------------------------------------------------ after sync
    def grad_norm(self) -> float:
        """The global 2-norm of the synced gradients, the same float on every active
        member: every element counted once in the job, one all-reduce of the parts."""
        return self.norm_and_sum(0.0)[0]

    def norm_and_sum(self, carry: float) -> tuple[float, float]:
        """``grad_norm()`` and, in the same all-reduce, the sum of ``carry`` over every
        active member of every stage (the loss, which only the last stage knows). With
        pipeline stages the group is the active members of all stages, so each stage's
        part of the norm is counted once."""
        parts = [self._sumsq(b.flat, b.routes.count_idx) for b in self.buckets]
        if self.repl_counted:
            parts.append(self._sumsq(self.repl.flat[:-1], None))
        total = torch.stack(parts).sum() if parts else torch.zeros((), device=self.device)
        total = torch.stack([total.to(torch.float32), torch.tensor(carry, dtype=torch.float32, device=self.device)])
        group = self.groups.active if self.groups.active is not None else self.groups.tp
        if group is not None:
            all_reduce(total, group)
        return float(total[0].sqrt()), float(total[1])

    @staticmethod
    def _sumsq(flat: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
        values = flat if idx is None else flat.index_select(0, idx)
        return values.square().sum()

    def scale(self, factor: float, sharded_only: bool = False) -> None:
        """Multiply the synced gradients (clipping; ``sharded_only`` is the test hook)."""
        for b in self.buckets:
            b.flat.mul_(factor)
        if not sharded_only:
            self.repl.flat[:-1].mul_(factor)

    def moved_bytes(self) -> int:
        """Bytes this member sent in the last step's pre- and post-sync moves together
        (both directions of the TP-group traffic, replicated gradients included), counted
        at the send: the sizes of the tensors handed to the collectives, not the routes'."""
        return self.step_sent_bytes

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
