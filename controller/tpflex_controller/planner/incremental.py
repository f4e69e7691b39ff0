"""Incremental re-planning (pure): after a change, plan again only the replicas it touches,
plus the ones a shared constraint really couples them with, and copy the rest of the
previous plan. ``replan(prev, ...)`` returns the same ``PlanResult`` as ``plan()`` of the
whole job on the same input (tests/controller/test_planner_incremental.py).

What couples replicas:
- a rack: its budget is water-filled over the boosted stages of every replica with a stage
  on it, and its usable GPUs count against it, so a change on a rack re-plans every
  replica with a stage there, and a re-planned replica pulls in the non-identity replicas
  sharing a rack with it (transitively);
- the spare pool (policy ``spare``): spare racks go to degraded replicas in index order,
  so every replica with an unusable GPU is planned again with the pool;
- anything else (another spec object, policy, power model, full degree) re-plans the job.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tpflex_proto.powermodel import PowerModel

from tpflex_controller.planner.gcpause import gc_paused
from tpflex_controller.planner.model import (
    ClusterState,
    JobOverrides,
    JobSpec,
    PlanResult,
    Policy,
)
from tpflex_controller.planner.planner import (
    PlanContext,
    ReplicaOutcome,
    assemble,
    context,
    plan_replicas,
)


@dataclass(frozen=True)
class Changes:
    """What changed in the cluster since the previous plan of a job."""

    # nodes whose GPUs changed status, speed or power pin, or whose liveness changed
    nodes: frozenset[str] = frozenset()
    # racks whose own data (budget, power limits) changed, the same GPUs, or that left the
    # cluster (the whole job is planned again then)
    racks: frozenset[str] = frozenset()


@dataclass(frozen=True)
class JobPlan:
    """A job's plan and what ``replan`` needs to change it: the non-identity outcomes and
    the inputs it was made from (compared by identity: specs are immutable)."""

    result: PlanResult
    job: JobSpec
    ctx: PlanContext
    outcomes: Mapping[int, ReplicaOutcome]
    index: _JobIndex = field(repr=False)
    replanned: int  # replicas planned to make it (all of them for a whole-job plan)


@dataclass(frozen=True)
class _JobIndex:
    rack_replicas: Mapping[str, tuple[int, ...]]  # stage rack -> replicas with a stage there
    replica_racks: tuple[tuple[str, ...], ...]  # replica -> its stage racks
    node_racks: Mapping[str, frozenset[str]]  # node -> racks (of the job's) it has GPUs in


def plan_job(
    cluster: ClusterState,
    job: JobSpec,
    *,
    policy: Policy | None = None,
    power_model: PowerModel | None = None,
    overrides: JobOverrides | None = None,
) -> JobPlan:
    """The whole-job plan, kept for ``replan``."""
    ctx = context(cluster, job, policy, power_model, overrides)
    outcomes = plan_replicas(ctx, cluster, job, range(len(job.replicas)))
    return JobPlan(assemble(ctx, job, outcomes), job, ctx, outcomes, _index(cluster, job), len(job.replicas))


@gc_paused
def replan(
    prev: JobPlan | None,
    cluster: ClusterState,
    job: JobSpec,
    changes: Changes | None,
    *,
    policy: Policy | None = None,
    power_model: PowerModel | None = None,
    overrides: JobOverrides | None = None,
) -> JobPlan:
    """Plan ``job`` again after ``changes`` (None: unknown, plan the whole job). The
    result equals ``plan(cluster, job, ...)``."""
    if prev is None or changes is None or prev.job is not job:
        return plan_job(cluster, job, policy=policy, power_model=power_model, overrides=overrides)
    # the spec is the one validated for ``prev``: only its racks' presence can change, and
    # a rack that left is a changed rack (``Changes.racks``): looked up alone, not all of
    # the job's thousands of racks on every change
    racks = cluster.racks
    known = all(r in racks for r in changes.racks) and all(r in racks for r in job.spare_racks)
    ctx = context(cluster, job, policy, power_model, overrides, prev.ctx.full_degree if known else None)
    old = prev.ctx
    if ctx.policy is not old.policy or ctx.model is not old.model or ctx.full_degree != old.full_degree:
        return plan_job(cluster, job, policy=policy, power_model=power_model, overrides=overrides)
    seeds = _seeds(prev, ctx, job, changes)
    indices = _coupled(prev, seeds)
    if ctx.policy is Policy.SPARE and (indices or changes.nodes or changes.racks):
        indices |= {i for i, o in prev.outcomes.items() if o.lost}
    order = sorted(indices)
    fresh = plan_replicas(ctx, cluster, job, order)
    outcomes = dict(prev.outcomes)  # copied in C: thousands of degraded replicas
    for i in indices:
        outcomes.pop(i, None)
    outcomes.update(fresh)
    replaced = {i: prev.outcomes.get(i) for i in order}
    result = assemble(ctx, job, outcomes, prev.result, replaced)
    return JobPlan(result, job, ctx, outcomes, prev.index, len(order))


def _seeds(prev: JobPlan, ctx: PlanContext, job: JobSpec, changes: Changes) -> set[int]:
    idx = prev.index
    racks = set(changes.racks)
    for node in changes.nodes:
        racks |= idx.node_racks.get(node, frozenset())
    seeds = {i for r in racks for i in idx.rack_replicas.get(r, ())}
    old_pins, new_pins = prev.ctx.pins, ctx.pins
    seeds.update(r for r in old_pins.keys() | new_pins.keys() if old_pins.get(r) != new_pins.get(r))
    return {i for i in seeds if 0 <= i < len(job.replicas)}


def _coupled(prev: JobPlan, seeds: Iterable[int]) -> set[int]:
    """``seeds`` and, transitively, every non-identity replica sharing a rack with one."""
    idx = prev.index
    out = set(seeds)
    frontier = list(out)
    seen_racks: set[str] = set()
    while frontier:
        i = frontier.pop()
        for rack in idx.replica_racks[i]:
            if rack in seen_racks:
                continue
            seen_racks.add(rack)
            for j in idx.rack_replicas[rack]:
                if j not in out and j in prev.outcomes:
                    out.add(j)
                    frontier.append(j)
    return out


def _index(cluster: ClusterState, job: JobSpec) -> _JobIndex:
    rack_replicas: dict[str, list[int]] = {}
    replica_racks = []
    for i, rep in enumerate(job.replicas):
        names = tuple(dict.fromkeys(st.rack for st in rep.stages))
        replica_racks.append(names)
        for name in names:
            rack_replicas.setdefault(name, []).append(i)
    node_racks: dict[str, set[str]] = {}
    for name in [*rack_replicas, *job.spare_racks]:
        for node in {g[0] for g in cluster.racks[name].gpus}:
            node_racks.setdefault(node, set()).add(name)
    return _JobIndex(
        {r: tuple(v) for r, v in rack_replicas.items()},
        tuple(replica_racks),
        {n: frozenset(v) for n, v in node_racks.items()},
    )
