"""Small all-reduces for latency-bound CPU runs.

gloo's ring all-reduce takes 2(n-1) dependent hops; on a few oversubscribed CPU cores each
hop waits for a process to be scheduled (about 0.5 ms here), so a 4-rank all-reduce of a
few KB costs ~4.5 ms. For small tensors on gloo, ``all_reduce`` instead exchanges the
whole tensor with every peer in one round of batched P2P and sums the contributions in
group-rank order, so every member gets bit-identical results. Other cases (nccl, large
tensors) use ``dist.all_reduce``.

An exchange waits only for what it receives. gloo can leave a send waiting until the
collective timeout after its peer's connection failed: a send queued for writing when the
connection breaks is not told (``tcp::Pair::signalException`` signals queued sends that
have a bound buffer, not an unbound one), and its pair is closed, so no abort reaches it.
It hit the demo's norm exchange when a peer, failing elsewhere, closed its connections
just after asking for our data (2 of 30 failures, a 60 s stall each). So each exchange
sends a copy of the tensor, and its sends are waited for (reaped) at the next exchange on
the group, once the same peer's contribution to that one has arrived: the peer started
the next exchange only after it received ours, so the wait returns at once. A send to a
peer that died is never waited for; it is dropped with the group. A process that stops
using its groups on purpose (``NtpRuntime.close``, a test's injected death "after the
step") first waits for what it still has in flight (``flush_sends``), bounded: otherwise a
peer still reading our last contribution would see the connection close under it.
"""

from __future__ import annotations

import logging
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from tpflex_trainer.ntp.local_group import LocalGroup

log = logging.getLogger(__name__)

DIRECT_MAX_BYTES = 256 * 1024
DIRECT_MAX_RANKS = 16


def _direct(tensor: torch.Tensor, group: dist.ProcessGroup) -> bool:
    return (
        dist.get_backend(group) == "gloo"
        and tensor.numel() * tensor.element_size() <= DIRECT_MAX_BYTES
        and dist.get_world_size(group) <= DIRECT_MAX_RANKS
    )


# group -> peer -> the sends of earlier exchanges to that peer, not waited for yet (each
# with the copy it sends). Weak: a destroyed group takes its sends with it.
_UNREAPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class PendingAllReduce:
    """An all-reduce in flight; ``wait()`` leaves the result in the tensor."""

    def __init__(self, tensor: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp) -> None:
        self.tensor, self.op = tensor, op
        self.done = False
        self.work = None
        self.exchange: Exchange | None = None
        if not _direct(tensor, group):
            self.work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
            return
        self.exchange = Exchange(tensor, group)

    def wait(self) -> torch.Tensor:
        """Idempotent: later calls return the result again."""
        if self.done:
            return self.tensor
        self.done = True
        if self.work is not None:
            self.work.wait()
            return self.tensor
        parts = self.exchange.wait()
        result = parts[0].clone()
        for part in parts[1:]:
            if self.op == dist.ReduceOp.MAX:
                torch.maximum(result, part, out=result)
            else:
                result.add_(part)
        self.tensor.copy_(result)
        return self.tensor


class Exchange:
    """Send ``tensor`` to every peer of ``group`` and post receives for theirs (one round,
    gloo P2P called on the group directly to keep the per-message overhead low); ``wait()``
    returns the contributions in group-rank order (ours included). The caller may change
    ``tensor`` as soon as this returns: a copy is sent."""

    def __init__(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        me, size = group.rank(), group.size()
        self.group = group
        payload = tensor.detach().clone()
        self.parts: list[torch.Tensor] = []
        self.recvs: list[tuple[int, object]] = []
        self.sends: dict[int, tuple[object, torch.Tensor]] = {}
        for peer in range(size):
            if peer == me:
                self.parts.append(tensor)
                continue
            buf = torch.empty_like(tensor)
            self.parts.append(buf)
            self.sends[peer] = (group.send([payload], peer, 0), payload)
            self.recvs.append((peer, group.recv([buf], peer, 0)))

    def wait(self) -> list[torch.Tensor]:
        earlier = _UNREAPED.setdefault(self.group, {})
        for peer, work in self.recvs:
            work.wait()
            for send, _ in earlier.pop(peer, ()):  # the peer has them: it is past that exchange
                send.wait()
        for peer, send in self.sends.items():
            earlier.setdefault(peer, []).append(send)
        return self.parts


def flush_sends(timeout_s: float = 10.0) -> int:
    """Wait for every send of this process's exchanges not reaped yet, all together for at
    most ``timeout_s`` (a peer that died leaves its send waiting: see the module doc), and
    forget them. Returns how many did not complete."""
    groups = list(_UNREAPED.items())
    _UNREAPED.clear()
    deadline = time.monotonic() + timeout_s
    failed = 0
    for _group, by_peer in groups:
        for peer, sends in by_peer.items():
            for work, _payload in sends:
                left = deadline - time.monotonic()
                try:
                    if left <= 0:
                        raise RuntimeError(f"no time left of {timeout_s:g} s")
                    work.wait(timedelta(seconds=left))
                except RuntimeError as exc:  # the peer is gone, or the wait timed out
                    failed += 1
                    log.warning("ntp a send to group rank %d did not complete: %s", peer, exc)
    return failed


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | LocalGroup) -> list[torch.Tensor]:
    """Every member's ``tensor`` in group-rank order (blocking)."""
    if isinstance(group, LocalGroup):
        return group.all_gather(tensor)
    if not _direct(tensor, group):
        out = [torch.empty_like(tensor) for _ in range(group.size())]
        dist.all_gather(out, tensor, group=group)
        return out
    return Exchange(tensor, group).wait()


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | LocalGroup,
               op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """Blocking all-reduce in place (SUM or MAX)."""
    if isinstance(group, LocalGroup):
        return group.all_reduce(tensor, "max" if op == dist.ReduceOp.MAX else "sum")
    return PendingAllReduce(tensor, group, op).wait()
