"""Pipeline stages of a nonuniform-TP job: pure functions, no torch, no I/O.

A replica is P stages; stage k is one scale-up domain with its own TP group and degree
and holds a contiguous range of the model's layers (stage 0 also the embedding, stage
P-1 the final norm, the output layer and the loss). Each stage is laid out on its own,
across the replicas, by ``layout.plan_layout``: its families are its layers' families,
its core partitions and t_min are those of stage k over the replicas (t_min of stage k is
the smallest degree of stage k), and the gradient-sync traffic bound holds per stage. A
failure lowers one stage's degree only; the other stages keep their layouts.

``one_f_one_b`` is the schedule each stage runs over the micro-batches of a step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from tpflex_trainer.ntp.errors import LayoutError
from tpflex_trainer.ntp.layout import (
    Derived,
    JobLayout,
    Member,
    ReplicaPlacement,
    balanced_sizes,
    plan_layout,
)

FIRST, LAST = "first", "last"  # the embedding's stage, the head's stage


def layer_ranges(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous, balanced layer ranges of the stages (earlier stages take the extra
    layers: the last stage also runs the output layer and the loss)."""
    if n_stages < 1:
        raise LayoutError(f"a pipeline needs at least 1 stage, got {n_stages}", code="bad_stages")
    if n_layers < n_stages:
        raise LayoutError(f"{n_layers} layers cannot fill {n_stages} stages (at least one layer each)",
                          code="bad_stages")
    out, start = [], 0
    for size in balanced_sizes(n_layers, n_stages):
        out.append(range(start, start + size))
        start += size
    return out


def stage_of(where: int | str, n_layers: int, n_stages: int) -> int:
    """The stage of a parameter: ``where`` is its layer index, FIRST or LAST."""
    if where == FIRST:
        return 0
    if where == LAST:
        return n_stages - 1
    for k, layers in enumerate(layer_ranges(n_layers, n_stages)):
        if where in layers:
            return k
    raise LayoutError(f"layer {where} is outside 0..{n_layers - 1}", code="bad_stages")


def split_stages(placements: Sequence[ReplicaPlacement], n_stages: int) -> tuple[tuple[ReplicaPlacement, ...], ...]:
    """Per stage, its placements. Every replica must place every stage once, with the same
    local batch on each (a replica runs one batch through all its stages)."""
    by_stage: list[list[ReplicaPlacement]] = [[] for _ in range(n_stages)]
    for p in placements:
        if not 0 <= p.stage < n_stages:
            raise LayoutError(f"replica {p.replica} places stage {p.stage}; the job has stages "
                              f"0..{n_stages - 1}", code="stage_out_of_range")
        by_stage[p.stage].append(p)
    replicas = sorted({p.replica for p in placements})
    batch: dict[int, int] = {}
    for k, ps in enumerate(by_stage):
        have = sorted(p.replica for p in ps)
        if have != replicas:
            missing = sorted(set(replicas) - set(have))
            raise LayoutError(f"stage {k} is not placed once for every replica (missing {missing}, "
                              f"placed {have})", code="missing_stage")
        for p in ps:
            if batch.setdefault(p.replica, p.local_batch) != p.local_batch:
                raise LayoutError(f"replica {p.replica} has local batch {batch[p.replica]} on one stage "
                                  f"and {p.local_batch} on stage {k}", code="stage_batch_mismatch")
    return tuple(tuple(ps) for ps in by_stage)


def plan_stages(
    stage_counts: Sequence[Mapping[str, int]],
    placements: Sequence[ReplicaPlacement],
    base_tp: int,
    previous: Sequence[JobLayout] | None = None,
    holders: Iterable[Member] | None = None,
    stage_derived: Sequence[Mapping[str, Derived]] | None = None,
) -> tuple[JobLayout, ...]:
    """One layout per stage (``layout.plan_layout`` on the stage's families and
    placements; sticky from the stage's previous layout). Units never cross stages."""
    per_stage = split_stages(placements, len(stage_counts))
    held = None if holders is None else [Member(*h) for h in holders]
    out = []
    for k, (counts, ps) in enumerate(zip(stage_counts, per_stage, strict=True)):
        prev = None
        if previous is not None:
            prev = next((lay for lay in previous if lay.stage == k), None)
        mine = None if held is None else [m for m in held if m.stage == k]
        derived = stage_derived[k] if stage_derived is not None else None
        out.append(plan_layout(counts, ps, base_tp, prev, mine, derived=derived))
    return tuple(out)


# ---------------------------------------------------------------------- schedule


class Action(NamedTuple):
    """One step of a stage's schedule. ``kind``: ``forward`` / ``backward`` (compute of
    micro-batch ``micro``) or a transfer with a neighbour stage (``send_*`` of ``micro``,
    ``recv_*`` of ``micro``). The paired forms ``send_forward_recv_backward`` and
    ``send_backward_recv_forward`` send ``micro`` and receive ``recv`` in one batch, so
    that neither neighbour waits on the other's send (NCCL and gloo P2P both rendezvous)."""

    kind: str
    micro: int
    recv: int = -1


_SKIP_FIRST = {"recv_forward", "send_backward", "send_backward_recv_forward"}
_SKIP_LAST = {"send_forward", "recv_backward", "send_forward_recv_backward"}


def one_f_one_b(stage: int, n_stages: int, micro_batches: int) -> list[Action]:
    """The non-interleaved 1F1B schedule of ``stage``: P-1-k warm-up forwards (fewer
    when there are fewer micro-batches), then one forward and one backward in turn, then
    the remaining backwards. Stage k holds at most P-k micro-batches' activations.
    The first stage receives nothing forward (it reads the tokens) and sends nothing
    backward; the last sends nothing forward (it computes the loss)."""
    if not 0 <= stage < n_stages or micro_batches < 1:
        raise LayoutError(f"no schedule for stage {stage} of {n_stages} with {micro_batches} micro-batches",
                          code="bad_stages")
    skip = (_SKIP_FIRST if stage == 0 else set()) | (_SKIP_LAST if stage == n_stages - 1 else set())
    warmup = min(n_stages - stage - 1, micro_batches)
    steady = micro_batches - warmup
    acts: list[Action] = []

    def add(kind: str, micro: int, recv: int = -1) -> None:
        if kind not in skip:
            acts.append(Action(kind, micro, recv))

    for i in range(warmup):
        add("recv_forward", i)
        add("forward", i)
        add("send_forward", i)
    if steady:
        add("recv_forward", warmup)
    for j in range(steady):
        add("forward", warmup + j)
        add("send_forward_recv_backward", warmup + j, j)
        add("backward", j)
        if j == steady - 1:
            add("send_backward", j)
        else:
            add("send_backward_recv_forward", j, warmup + j + 1)
    for i in range(steady, micro_batches):
        add("recv_backward", i)
        add("backward", i)
        add("send_backward", i)
    return acts
