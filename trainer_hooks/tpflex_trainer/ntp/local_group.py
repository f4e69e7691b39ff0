"""An in-process TP group whose members are threads of one process: the collectives the
TP layers use (all-reduce, all-gather), exchanged through shared memory. The fidelity
self-test runs a miniature model's members this way before any process group exists.
Reductions add the members' tensors in group-rank order, so every member gets
bit-identical results, as ``collectives.all_reduce`` guarantees for process groups."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch


class LocalGroupError(RuntimeError):
    """A member failed or timed out: the others are released with this error."""


class _Shared:
    def __init__(self, size: int, timeout_s: float) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout_s)
        self.slots: list[torch.Tensor | None] = [None] * size


class LocalGroup:
    """Member ``rank`` of a group of ``size`` threads (build them with ``local_groups``)."""

    def __init__(self, shared: _Shared, rank: int) -> None:
        self._shared, self._rank = shared, rank

    def size(self) -> int:
        return self._shared.size

    def rank(self) -> int:
        return self._rank

    def _wait(self) -> None:
        try:
            self._shared.barrier.wait()
        except threading.BrokenBarrierError as exc:
            raise LocalGroupError("a member of the local group failed") from exc

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every member's ``tensor`` in rank order (copies)."""
        s = self._shared
        s.slots[self._rank] = tensor.detach().clone()
        self._wait()
        parts = [t.clone() for t in s.slots]
        self._wait()  # nobody writes the slots again before everyone has read them
        return parts

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place: the sum (or ``op="max"``) of the members' tensors, in rank order."""
        parts = self.all_gather(tensor)
        out = parts[0]
        for part in parts[1:]:
            out = torch.maximum(out, part) if op == "max" else out + part
        tensor.copy_(out)
        return tensor

    def abort(self) -> None:
        self._shared.barrier.abort()


def local_groups(size: int, timeout_s: float = 120.0) -> list[LocalGroup]:
    shared = _Shared(size, timeout_s)
    return [LocalGroup(shared, r) for r in range(size)]


def run_members(groups: Sequence[LocalGroup], fn: Callable[[int], object]) -> list[object]:
    """``fn(rank)`` on one thread per member; the results in rank order. The first error
    (the one that broke the group, not the others' ``LocalGroupError``) is raised."""
    results: list[object] = [None] * len(groups)
    errors: list[BaseException | None] = [None] * len(groups)

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors[rank] = exc
            groups[rank].abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"tpflex-local-{r}", daemon=True)
               for r in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, LocalGroupError)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
