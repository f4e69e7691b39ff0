"""The planner's common case in one pass (pure): ntp-pw replicas of one stage over a
whole rack, with no power pins or slow GPUs in the cluster, no operator pin on the
replica, all the rack's nodes live and at least one of its GPUs failed or drained.

(Its rack's GPUs report one max limit, above TDP.) Such a replica is planned exactly as ``planner.plan_replicas`` plans it (a draft, the
ntp-pw decision, the lone-stage boost of ``power.plan_boosts``, ``_assign`` and
``reasons.replica_reasons``), but without the intermediate objects: its lost GPUs are
found from the touched GPUs of the rack's nodes by position, and what depends only on
the stage's shape (lost-GPU count, degree, the rack's power numbers) -- the cap, the
speed, the throughput, the batch and the texts -- is computed once per shape of a plan
call. Everything else (dead nodes, degraded-but-usable GPUs, a dropped replica, a rack
claimed by two replicas, pins, other policies) goes through the general path.
tests/controller/test_planner_lone.py compares the two on random clusters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from tpflex_controller.planner import power
from tpflex_controller.planner.caps import UniformCaps
from tpflex_controller.planner.model import (
    JobSpec,
    ReplicaAssignment,
    ReplicaState,
    StageAssignment,
    full_tp,
)
from tpflex_controller.planner.reasons import _batch, _ntp_pw_tail
from tpflex_controller.planner.stages import StageDraft, Survey

_DEGRADED = ReplicaState.DEGRADED
_EPS = 1e-9


class _Shape:
    """What a lone degraded stage's plan depends on besides its GPUs and names."""

    __slots__ = ("batch", "batch_text", "cap", "degree", "rel", "state", "tail", "usable_of", "why")


def plan_lone(
    survey: Survey,
    job: JobSpec,
    indices: Iterable[int],
    pins,
    full_degree: int,
    curve: power.Curve,
    outcome,
) -> tuple[dict, list[int]]:
    """(outcomes of the replicas planned here, the other indices in order). ``outcome``
    builds a ``planner.ReplicaOutcome``. Correct only under ntp-pw with no power pins and
    no slow GPUs in the cluster (the caller checks)."""
    cluster = survey.cluster
    racks, replicas = cluster.racks, job.replicas
    live, by_node, unusable = survey.live, survey.by_node, survey.unusable
    touched_nodes, status = survey.touched_nodes, cluster.gpu_status
    by_rack, down_racks = survey.by_rack, survey.down_racks  # the view's indexes, or None
    min_tp = job.min_tp
    can_be_identity = full_degree == job.base_tp
    shapes: dict[tuple, _Shape] = {}
    done: dict[int, object] = {}
    owner: dict[str, int] = {}  # rack -> the replica planned here on it
    rest: list[int] = []
    clash: set[str] = set()
    for i in indices:
        stages = replicas[i].stages
        if i in pins or len(stages) != 1:
            rest.append(i)
            continue
        spec = stages[0]
        gpus = spec.gpus
        rack = racks[spec.rack]
        nodes = rack.nodes
        if (gpus is not rack.gpus and gpus != rack.gpus) or not nodes:
            rest.append(i)
            continue
        if by_rack is not None:  # by the rack's key: a rack's name field may differ
            held = by_rack.get(spec.rack)
            if held is None or spec.rack in down_racks:
                if held is None and can_be_identity and spec.rack not in down_racks:
                    continue  # clean: the identity assignment
                rest.append(i)
                continue
            at = _lost_among(gpus, nodes, held, unusable)
        else:
            if touched_nodes.isdisjoint(nodes):
                if can_be_identity and (live is None or live.issuperset(nodes)):
                    continue  # clean: the identity assignment
                rest.append(i)
                continue
            if live is not None and not live.issuperset(nodes):
                rest.append(i)
                continue
            held = [g for node in touched_nodes.intersection(nodes) for g in by_node[node]]
            at = _lost_among(gpus, nodes, held, unusable)
        if not at or rack.gpu_max_w or power.no_headroom(rack.max_w, rack.tdp_w):
            # touched but nothing lost (or not found by position), per-GPU limits, or no
            # headroom (run as plain ntp): the general path plans it
            rest.append(i)
            continue
        n = len(gpus)
        left = n - len(at)
        degree = left if left < full_degree else full_degree
        if degree < 1 or degree < min_tp:
            rest.append(i)  # dropped: the general path words it
            continue
        name = rack.name
        if name in owner:
            clash.add(name)
        owner[name] = i
        if len(at) == 1:  # the common case: one lost GPU
            p = at[0]
            usable = gpus[:p] + gpus[p + 1:]
            g = gpus[p]
            described = f"{g[0]}:{g[1]} {status[g]._value_}"
        else:
            usable = _without(gpus, at)
            # stages.describe_lost (an enum's _value_ is a plain attribute, its hash is not)
            described = ", ".join([f"{g[0]}:{g[1]} {status[g]._value_}" for g in map(gpus.__getitem__, at)])
        key = (rack.tdp_w, rack.max_w, rack.power_budget_w, n, left, degree)
        shape = shapes.get(key)
        if shape is None:
            shape = shapes[key] = _shape(cluster, rack, gpus, usable, degree, job, curve)
        used = usable[:degree]
        caps = {} if shape.cap is None else UniformCaps(used, shape.cap)
        assignment = ReplicaAssignment(
            i, shape.state, (StageAssignment(name, degree, used, 0),), degree, shape.batch, shape.rel, shape.why
        )
        line = f"replica {i}: rack {name} has {shape.usable_of}{described}){shape.tail}"
        if shape.rel < 1.0 - 1e-12:
            reasons = (line, f"replica {i}: boost falls short -> {shape.batch_text}")
        else:
            reasons = (line,)
        done[i] = outcome(assignment, caps, reasons, None, True)
    if clash or (done and rest):
        _give_back(done, owner, clash, rest, replicas)
    return done, rest


def _give_back(done: dict, owner: dict[str, int], clash: set[str], rest: list[int], replicas) -> None:
    """Replicas planned here whose rack another replica also claims go to the general path
    (a rack's budget couples them)."""
    shared = set(clash)
    for i in rest:
        for st in replicas[i].stages:
            if st.rack in owner:
                shared.add(st.rack)
    if not shared:
        return
    back = [i for i, o in done.items() if o.assignment.stages[0].rack in shared]
    for i in back:
        del done[i]
    rest.extend(back)
    rest.sort()


def _lost_among(gpus, nodes, held, unusable) -> list[int] | None:
    """The sorted positions in ``gpus`` (the whole rack) of its unusable GPUs among
    ``held``, the touched GPUs of the rack's nodes; None when one of them is not where its
    node's position puts it (the general path finds it then)."""
    per, extra = divmod(len(gpus), len(nodes))
    if extra:
        return None
    at: list[int] = []
    for g in held:
        index = g[1]
        try:
            p = nodes.index(g[0]) * per + index
        except ValueError:  # not a node of this rack: the index is not the racks'
            return None
        if not 0 <= index < per or gpus[p] != g:
            return None
        if g in unusable:
            at.append(p)
    at.sort()
    return at


def _without(gpus: tuple, at: list[int]) -> tuple:
    usable: tuple = ()
    start = 0
    for p in at:
        usable += gpus[start:p]
        start = p + 1
    return usable + gpus[start:]


def _shape(cluster, rack, gpus, usable, degree: int, job: JobSpec, curve: power.Curve) -> _Shape:
    """The parts of a lone stage's plan that its shape decides, through the general code
    (``power.plan_boosts``, ``power.plain_stage_speed``, the planner's arithmetic)."""
    draft = StageDraft(0, rack, gpus, usable, (), degree)
    full = full_tp(job)
    power.plan_boosts([draft], cluster, full, curve)
    out = _Shape()
    out.degree = degree
    out.cap = draft.cap_w
    speed = power.plain_stage_speed(draft, curve)
    rel = min(1.0, degree * speed / full)
    out.rel = rel
    out.batch = max(1, math.floor(job.local_batch * rel + 1e-9))
    # planner._assign's state and wording: at T with an in-rack spare standing in, healthy
    out.state = _DEGRADED if degree < full or rel < 1.0 - 1e-12 else ReplicaState.HEALTHY
    out.why = "healthy" if out.state is ReplicaState.HEALTHY else f"degraded: TP {degree}, {rel:.3f}x throughput"
    out.usable_of = f"{len(usable)}/{len(gpus)} usable GPUs ("
    out.tail = _ntp_pw_tail(draft, curve)
    probe = ReplicaAssignment(0, out.state, (), degree, out.batch, rel, out.why)
    out.batch_text = _batch(probe, job)
    return out

