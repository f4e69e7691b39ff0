"""One replica's step through its pipeline stages: 1F1B over the micro-batches, with the
activations exchanged between stages whose TP degrees may differ.

Inside a stage every TP member holds the same activation (the stage output after the
last row-parallel reduction) and the same input gradient (after the copy-to-TP
all-reduce). So the activation crosses a stage boundary *once*: the first member (TP rank
0) of stage k sends it to the first member of stage k+1, which broadcasts it inside its
own TP group (a scale-up domain: NVLink on GPUs); the input gradient goes back the same
way. Any degrees on either side (TP 3 sending to TP 4) cost the same inter-stage bytes,
the lower bound: one activation per micro-batch and boundary forward, one gradient back.

The schedule is ``stages.one_f_one_b`` (our own, not torch.distributed.pipelining: that
one owns the model split and the loss, while here the stages are the NTP runtime's
per-stage modules with their own TP groups, gradient-sync hooks and reshards, and the
transfers must go rank 0 to rank 0 plus a broadcast, which its P2P stage I/O cannot
express). Paired transfers are posted together (``batch_isend_irecv``) as in Megatron-LM,
so neither neighbour blocks on the other's send. With one stage the schedule is the plain
gradient-accumulation loop: forward, backward per micro-batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tpflex_trainer.ntp.layout import JobLayout, Member
from tpflex_trainer.ntp.stages import Action, one_f_one_b


@dataclass(frozen=True)
class StageLinks:
    """Where one member's activations come from and go to (global ranks)."""

    stage: int
    n_stages: int
    root: bool  # TP rank 0 of its stage: the member that talks to the neighbour stages
    root_rank: int  # global rank of the stage's root (source of the broadcasts)
    prev_rank: int | None  # root of the previous stage of this replica
    next_rank: int | None  # root of the next stage

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.n_stages - 1


def stage_links(layouts: Sequence[JobLayout], world: Mapping[Member, int], me: Member) -> StageLinks:
    k = me.stage
    roots = [world[lay.replica(me.replica).members[0].member] for lay in layouts]
    return StageLinks(
        stage=k, n_stages=len(layouts), root=roots[k] == world[me], root_rank=roots[k],
        prev_rank=roots[k - 1] if k > 0 else None,
        next_rank=roots[k + 1] if k + 1 < len(layouts) else None,
    )


class PipelineStep:
    """Runs one step's forwards and backwards of this member's stage. ``sent_bytes``:
    activation and gradient bytes this member sent to other stages (cumulative);
    ``broadcast_bytes``: bytes it broadcast inside its TP group as the root."""

    def __init__(self, model, links: StageLinks, tp_group, tp_degree: int, hidden: int,
                 autocast_bf16: bool = False) -> None:
        self.model, self.links, self.tp, self.degree = model, links, tp_group, tp_degree
        self.hidden, self.bf16 = hidden, autocast_bf16
        self.sent_bytes = 0
        self.broadcast_bytes = 0
        # (seed, step, the replica's first sample in the global batch): keys dropout masks
        self.dropout_at: tuple[int, int, int] | None = None

    # ------------------------------------------------------------------ transfers
    def _buffer(self, rows: int, seq: int, device: torch.device) -> torch.Tensor:
        return torch.empty((rows, seq, self.hidden), dtype=torch.float32, device=device)

    def _exchange(self, sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[torch.Tensor, int, int]]) -> None:
        """The root posts its sends and receives together and waits; then every member of
        the stage gets the received tensors by a broadcast from the root."""
        if self.links.root:
            ops = [dist.P2POp(dist.isend, t, peer, tag=tag) for t, peer, tag in sends]
            ops += [dist.P2POp(dist.irecv, t, peer, tag=tag) for t, peer, tag in recvs]
            for t, _, _ in sends:
                self.sent_bytes += t.numel() * t.element_size()
            if ops:
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
        if self.tp is not None:
            for t, _, _ in recvs:
                dist.broadcast(t, src=self.links.root_rank, group=self.tp)
                if self.links.root:
                    self.broadcast_bytes += t.numel() * t.element_size() * (self.degree - 1)

    # ------------------------------------------------------------------ the step
    def run(self, chunks: list[tuple[torch.Tensor, torch.Tensor]], local_batch: int) -> torch.Tensor:
        """Every micro-batch forward and backward in 1F1B order; returns this member's
        part of the replica's loss (its weighted mean on the last stage, 0 elsewhere)."""
        links = self.links
        device = chunks[0][0].device
        seq = chunks[0][0].shape[1]
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        grads: dict[int, torch.Tensor] = {}
        local_loss = torch.zeros((), device=device)
        fwd_tag = lambda i: 2 * i  # noqa: E731
        bwd_tag = lambda i: 2 * i + 1  # noqa: E731

        def recv_forward(i: int) -> tuple[torch.Tensor, int, int]:
            inputs[i] = self._buffer(chunks[i][0].shape[0], seq, device)
            return inputs[i], links.prev_rank, fwd_tag(i)

        def recv_backward(i: int) -> tuple[torch.Tensor, int, int]:
            grads[i] = self._buffer(chunks[i][0].shape[0], seq, device)
            return grads[i], links.next_rank, bwd_tag(i)

        def send_forward(i: int) -> tuple[torch.Tensor, int, int]:
            return outputs[i].detach(), links.next_rank, fwd_tag(i)

        def send_backward(i: int) -> tuple[torch.Tensor, int, int]:
            return inputs.pop(i).grad.contiguous(), links.prev_rank, bwd_tag(i)

        for act in one_f_one_b(links.stage, links.n_stages, len(chunks)):
            kind, i = act.kind, act.micro
            if kind == "forward":
                self._forward(act, chunks, inputs, outputs)
            elif kind == "backward":
                local_loss += self._backward(i, chunks, outputs, grads, local_batch)
            elif kind == "recv_forward":
                self._exchange([], [recv_forward(i)])
            elif kind == "recv_backward":
                self._exchange([], [recv_backward(i)])
            elif kind == "send_forward":
                self._exchange([send_forward(i)], [])
            elif kind == "send_backward":
                self._exchange([send_backward(i)], [])
            elif kind == "send_forward_recv_backward":
                self._exchange([send_forward(i)], [recv_backward(act.recv)])
            elif kind == "send_backward_recv_forward":
                self._exchange([send_backward(i)], [recv_forward(act.recv)])
        return local_loss

    def _forward(self, act: Action, chunks, inputs, outputs) -> None:
        i = act.micro
        x, y = chunks[i]
        links = self.links
        if not links.first:
            x = inputs[i].requires_grad_()
        ctx = torch.autocast(x.device.type, dtype=torch.bfloat16) if self.bf16 else nullcontext()
        keyed = getattr(self.model, "dropout_scope", None)
        drop = nullcontext()
        if keyed is not None and self.dropout_at is not None:
            seed, step, first = self.dropout_at
            first += sum(chunks[j][0].shape[0] for j in range(i))
            drop = keyed(seed, step, first, chunks[i][0].shape[0])
        with ctx, drop:
            if links.first and links.last:
                out = self.model.loss(x, y)  # one stage: the whole model
            elif links.last:
                out = self.model.stage_loss(x, y)
            else:
                out = self.model.forward_stage(x)
        outputs[i] = out.float()

    def _backward(self, i: int, chunks, outputs, grads, local_batch: int) -> torch.Tensor:
        out = outputs.pop(i)
        if self.links.last:
            loss = out * (chunks[i][0].shape[0] / local_batch)
            loss.backward()
            return loss.detach()
        out.backward(grads.pop(i))
        return torch.zeros((), device=out.device)
