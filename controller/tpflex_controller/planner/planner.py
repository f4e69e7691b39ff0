"""The NTP planner: ``plan(cluster, job, ...) -> PlanResult``. Pure: no I/O, no clock.

Semantics (DESIGN.md "NTP math"):
- Per replica and pipeline stage, the usable GPUs of the stage in spec order. A stage's
  degree is the number usable, capped by the smallest unit count of the job's families
  (every rank needs >= 1 unit of each) and by the operator's pin for the replica. The
  GPUs used are the first ``degree`` usable ones in spec order (TP-rank order = spec
  order), so the same input always gives the same plan.
- ``ntp-pw`` (default): only a reduced stage runs reduced, boosted to the speed it needs
  (see ``power.py``); if the boost falls short, the replica's local batch shrinks.
- ``ntp``: every stage of a degraded replica runs at the replica's smallest degree t_r,
  local batch ~ t_r / T; no boost.
- ``dp-drop``: a replica with any unusable GPU is dropped.
- ``spare``: a stage with an unusable GPU moves to a healthy spare rack (full TP); with
  none left, the replica is dropped.
- Under ntp and ntp-pw a replica with a stage of no usable GPU, or below ``min_tp``, is
  dropped until repaired.
- A replica's relative throughput (samples/s vs a healthy replica) is its slowest
  stage's ``min(1, degree * speed / T)``, where speed is the slowest used GPU's relative
  speed times the power model's throughput at its cap. Its local batch is
  ``max(1, floor(local_batch * relative_throughput))``; 0 when dropped.
- ``expected_throughput_ratio`` is the mean relative throughput over replicas.
- Shards may be uneven (64 heads on 7 GPUs: 9,9,9,9,9,9,10), so a degree need not divide
  the unit counts; it may only not exceed the smallest one.
- Speed: replicas whose GPUs are all healthy, live, unpinned and at full speed get the
  identity assignment without per-GPU work (set checks memoised on the spec objects, see
  ``memo.py``); reuse JobSpec objects between plans to benefit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sized
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

from tpflex_proto.powermodel import DEFAULT_POWER_MODEL, PowerModel

from tpflex_controller.planner import power
from tpflex_controller.planner.caps import MergedCaps, UniformCaps
from tpflex_controller.planner.checks import pin_problem, valid_pins, validate  # noqa: F401 (re-exported)
from tpflex_controller.planner.gcpause import gc_paused
from tpflex_controller.planner.lone import plan_lone
from tpflex_controller.planner.memo import IdentityMemo
from tpflex_controller.planner.model import (
    ClusterState,
    GpuKey,
    JobOverrides,
    JobSpec,
    PlanResult,
    Policy,
    ReplicaAssignment,
    ReplicaSpec,
    ReplicaState,
    StageAssignment,
    SuspendedPin,
    evict,
    full_tp,
    remember_changed,
    remember_moved,
)
from tpflex_controller.planner.reasons import replica_reasons
from tpflex_controller.planner.stages import (
    ReplicaDraft,
    StageDraft,
    Survey,
    decide_dp_drop,
    decide_ntp,
    decide_ntp_pw,
    decide_spare,
    replica_draft,
    spare_pool,
)

_NO_OVERRIDES = JobOverrides()
# a plan of n replicas surveys lazily when n times this is below the nodes with touched
# GPUs: a lazy look at a replica's rack asks about each of its nodes (18 in an NVL72)
_LAZY_PER_REPLICA = 8
_throughput_of = attrgetter("relative_throughput")
_STATE_NAMES = {s: s.value for s in ReplicaState}  # an enum's .value is a slow descriptor
_DECIDE = {Policy.NTP_PW: decide_ntp_pw, Policy.NTP: decide_ntp, Policy.DP_DROP: decide_dp_drop}


@gc_paused
def plan(
    cluster: ClusterState,
    job: JobSpec,
    *,
    policy: Policy | None = None,
    power_model: PowerModel | None = None,
    overrides: JobOverrides | None = None,
    now: float = 0.0,
) -> PlanResult:
    """Plan ``job`` on ``cluster``. The effective policy is ``policy``, else the
    overrides' policy, else the job's. ``now`` is accepted for a uniform signature; the
    decision does not depend on time. Raises ``PlanningError`` for a bad spec. An operator
    pin that cannot hold (invalid for the spec, or above the usable GPUs of a stage of its
    replica) never blocks the plan: it is suspended (``PlanResult.suspended_pins``, with a
    reason) and its replica planned as if unpinned, so a failed or drained GPU always
    leaves the plan. ``incremental.replan`` gives the same result for a change."""
    ctx = context(cluster, job, policy, power_model, overrides)
    outcomes = plan_replicas(ctx, cluster, job, range(len(job.replicas)))
    return assemble(ctx, job, outcomes)


@dataclass(frozen=True)
class PlanContext:
    """What every replica of one plan shares: the policy, power model, full degree and the
    operator's pins (the valid ones, and those invalid for the spec)."""

    policy: Policy
    model: PowerModel
    full_degree: int
    pins: Mapping[int, int]
    invalid_pins: tuple[SuspendedPin, ...]


@dataclass(slots=True)
class ReplicaOutcome:
    """One replica's part of a plan that differs from the identity assignment."""

    assignment: ReplicaAssignment
    caps: Mapping[GpuKey, float]
    reasons: tuple[str, ...]
    unheld: SuspendedPin | None  # its pin, suspended because it cannot hold now
    lost: bool  # a stage of its spec has an unusable GPU (it may hold a spare rack)


def context(
    cluster: ClusterState,
    job: JobSpec,
    policy: Policy | None,
    power_model: PowerModel | None,
    overrides: JobOverrides | None,
    full_degree: int | None = None,
) -> PlanContext:
    """``full_degree``: the result of ``validate(cluster, job)`` when the caller knows it
    (the same spec object, validated on a cluster with the same racks)."""
    overrides = overrides or _NO_OVERRIDES
    eff = Policy(policy or overrides.policy or job.policy)
    if full_degree is None:
        full_degree = validate(cluster, job)
    pins, invalid = valid_pins(job, overrides.pins, full_degree)
    return PlanContext(eff, power_model or DEFAULT_POWER_MODEL, full_degree, pins, tuple(invalid))


def plan_replicas(
    ctx: PlanContext, cluster: ClusterState, job: JobSpec, indices: Iterable[int], *, lone: bool = True,
    lazy: bool | None = None,
) -> dict[int, ReplicaOutcome]:
    """Plan the replicas ``indices`` (ascending) together; a replica left out of the result
    gets the identity assignment. Correct on its own only when ``indices`` hold every
    replica the ones planned are coupled with (a rack whose budget they share, the spare
    pool): ``plan`` passes all, ``incremental.replan`` the coupled ones. ``lone``: the
    common case's one-pass planning (``lone.py``) where it applies; False plans every
    replica through the general path (the reference its tests compare with). ``lazy``:
    whether the survey looks touched GPUs up as asked (``stages.Survey``; None: when the
    replicas are few against the nodes with touched GPUs, and the view's index is there)."""
    pins = {r: t for r, t in ctx.pins.items()}
    if lazy is None:
        touched = cluster.touched_by_node
        lazy = touched is not None and isinstance(indices, Sized) and len(indices) * _LAZY_PER_REPLICA < len(touched)
    survey = Survey(cluster, lazy=lazy)
    curve = power.Curve(ctx.model)
    if lone and ctx.policy is Policy.NTP_PW and not (cluster.power_pins or cluster.gpu_speed):
        done, indices = plan_lone(survey, job, indices, pins, ctx.full_degree, curve, ReplicaOutcome)
        if not indices:
            return done
        out = _plan_general(ctx, survey, curve, job, pins, indices)
        done.update(out)
        return done
    return _plan_general(ctx, survey, curve, job, pins, indices)


def _plan_general(
    ctx: PlanContext, survey: Survey, curve: power.Curve, job: JobSpec, pins: dict[int, int],
    indices: Iterable[int],
) -> dict[int, ReplicaOutcome]:
    cluster = survey.cluster
    drafts = _drafts(survey, job, pins, ctx.full_degree, indices)
    lost = {d.index for d in drafts if d.lost_any}
    _decide(ctx.policy, drafts, cluster, job)
    unheld = _unheld_pins(drafts, pins)
    if unheld:  # plan those replicas again as if unpinned (pins never change spare moves)
        gone = {p.replica for p in unheld}
        pins = {r: t for r, t in pins.items() if r not in gone}
        drafts = _drafts(survey, job, pins, ctx.full_degree, indices)
        _decide(ctx.policy, drafts, cluster, job)
    if ctx.policy is Policy.NTP_PW:
        power.plan_boosts(
            (s for d in drafts if d.state is not ReplicaState.DROPPED for s in d.stages),
            cluster,
            ctx.full_degree,
            curve,
        )
        _fall_back_without_headroom(drafts, job)
    held = {p.replica: p for p in unheld}
    plain = _plain_ntp_alternatives(ctx, survey, job, drafts, pins)
    out: dict[int, ReplicaOutcome] = {}
    for d in drafts:
        assignment, caps = _assign(d, cluster, job, curve)
        alt = plain.get(d.index)
        if alt is not None:
            alt_assignment, alt_caps = _assign(alt, cluster, job, curve)
            if alt_assignment.relative_throughput > assignment.relative_throughput + 1e-12:
                d, assignment, caps = alt, alt_assignment, alt_caps
        reasons = replica_reasons(
            d, assignment, job, ctx.policy, caps, cluster.gpu_speed, cluster.power_pins, curve
        )
        out[d.index] = ReplicaOutcome(assignment, caps, tuple(reasons), held.get(d.index), d.index in lost)
    return out


def _fall_back_without_headroom(drafts: list[ReplicaDraft], job: JobSpec) -> None:
    """ntp-pw: a degraded replica none of whose reduced stages can be boosted (its GPUs'
    max limit is their default, as on many H100/H200 SXM boards; ``power.py``) runs as
    plain ntp: every stage at the replica's smallest degree, no boost, a local batch
    ~ t_r / T, and the reason says so."""
    full = full_tp(job)
    for d in drafts:
        if d.state is ReplicaState.DROPPED:
            continue
        reduced = [s for s in d.stages if s.degree < full]
        if not reduced or not all(s.no_headroom for s in reduced):
            continue
        needy = [s for s in d.stages if s.needed_speed > 1.0 + 1e-9]
        if not all(s.no_headroom for s in needy):
            continue  # a slow stage that can be boosted: keep ntp-pw (it shrinks the batch)
        d.fallback = f"NTP (no power headroom: {'; '.join(map(power.headroom_text, reduced))})"
        for s in d.stages:
            s.cap_w = None
        decide_ntp(d, job)


def _plain_ntp_alternatives(
    ctx: PlanContext, survey: Survey, job: JobSpec, drafts: list[ReplicaDraft],
    pins: Mapping[int, int],
) -> dict[int, ReplicaDraft]:
    """ntp-pw only: the plain-ntp drafts of the replicas that use a GPU pinned below TDP or
    running slow. Plain ntp (every stage at the replica's smallest degree, no boost) is a
    valid ntp-pw layout, and it can be the faster one when a stage kept at full degree
    holds such a GPU; the caller keeps whichever is faster. Dropping a replica's boost only
    frees rack budget, so the other replicas' caps stay valid."""
    cluster = survey.cluster
    if ctx.policy is not Policy.NTP_PW or not (cluster.power_pins or cluster.gpu_speed):
        return {}
    candidates = [d.index for d in drafts if d.state is not ReplicaState.DROPPED
                  and any(_holds_slow_gpu(s, cluster) for s in d.stages)]
    if not candidates:
        return {}
    alts = _drafts(survey, job, pins, ctx.full_degree, candidates)
    _decide(Policy.NTP, alts, cluster, job)
    return {a.index: a for a in alts if a.state is not ReplicaState.DROPPED}


def _holds_slow_gpu(stage: StageDraft, cluster: ClusterState) -> bool:
    pins, rack = cluster.power_pins, stage.rack
    for g in (set(cluster.gpu_speed) | set(pins)).intersection(stage.used):
        if g in cluster.gpu_speed or power.pinned_w(rack, pins[g], g) < rack.tdp_w:
            return True
    return False


def assemble(
    ctx: PlanContext,
    job: JobSpec,
    outcomes: Mapping[int, ReplicaOutcome],
    base: PlanResult | None = None,
    replaced: Mapping[int, ReplicaOutcome | None] | None = None,
) -> PlanResult:
    """The job's plan from the outcomes of its non-identity replicas. With ``base`` (an
    earlier plan of the job) and ``replaced`` (the earlier outcome, None for identity, of
    each replica planned again since), the rest is copied from ``base``."""
    if base is None:
        replicas = _with_identities(outcomes, job)
        parts = _parts_of(outcomes)
        caps = MergedCaps(parts)
        said = {i: o.reasons for i, o in outcomes.items() if o.reasons}
    else:
        replaced = replaced or {}
        replicas = list(base.replicas)
        parts = dict(base.cap_parts) if base.cap_parts is not None else _parts_of(outcomes)
        said = (dict(base.reason_parts) if base.reason_parts is not None
                else {i: o.reasons for i, o in outcomes.items() if o.reasons})
        for i in replaced:
            replicas[i] = _outcome_or_identity(outcomes, job, i)
            parts.pop(i, None)
            said.pop(i, None)
            if i in outcomes:
                if outcomes[i].caps:
                    parts[i] = outcomes[i].caps
                if outcomes[i].reasons:
                    said[i] = outcomes[i].reasons
        old_caps = base.power_caps
        caps = old_caps.derive(parts, replaced) if isinstance(old_caps, MergedCaps) else MergedCaps(parts)
    reasons = tuple(chain.from_iterable(map(said.__getitem__, sorted(said))))
    unheld = [outcomes[r].unheld for r in ctx.pins if r in outcomes and outcomes[r].unheld is not None]
    suspended = [*ctx.invalid_pins, *unheld]
    reasons += tuple(f"replica {p.replica}: operator pin suspended: {p.reason}" for p in suspended)
    replicas = tuple(replicas)
    ratio = _throughput_sum(replicas, base, replaced) / len(replicas)
    result = PlanResult(
        job.name, ctx.policy, replicas, caps, ratio, reasons, tuple(sorted(suspended)), parts, said
    )
    if base is not None and len(base.replicas) == len(replicas):
        changed = sorted(replaced)
        remember_moved(base.replicas, replicas, changed)  # the others are base's objects
        if base.cap_parts is not None and base.reason_parts is not None:
            remember_changed(base, result, changed)
    return result


def _throughput_sum(
    replicas: tuple[ReplicaAssignment, ...], base: PlanResult | None, replaced: Mapping[int, object] | None
) -> float:
    """The replicas' relative throughputs summed exactly, then rounded once (``math.fsum``:
    the same float in any order). A re-plan updates its base's exact sum with the replicas
    it replaced (O(replaced), not a walk of the job's thousands of replicas)."""
    if base is not None and replaced is not None and len(base.replicas) == len(replicas):
        kept = _SUMS.get(id(base.replicas))
        try:
            # else the base's sum once (a plan read back from etcd, a whole-job plan)
            exact = kept[1] if kept is not None and kept[0] is base.replicas else _exact_sum(base.replicas)
            for i in replaced:
                exact += _exact(replicas[i].relative_throughput) - _exact(base.replicas[i].relative_throughput)
        except (OverflowError, ValueError):  # an infinite or NaN throughput
            return math.fsum(map(_throughput_of, replicas))
        _remember_sum(replicas, exact)
        return exact / _ONE  # correctly rounded, as fsum's
    return math.fsum(map(_throughput_of, replicas))  # in C


# an exact sum of doubles as an integer count of 2**-1074 (the smallest subnormal)
_ONE = 1 << 1074
_SUMS: dict[int, tuple[tuple[ReplicaAssignment, ...], int]] = {}  # id(replicas) -> (them, exact sum)
_MAX_SUMS = 16


def _exact(x: float) -> int:
    n, d = x.as_integer_ratio()  # d = 2**k, k <= 1074 for a finite double
    return n << (1075 - d.bit_length())


def _exact_sum(replicas: tuple[ReplicaAssignment, ...]) -> int:
    return sum(map(_exact, map(_throughput_of, replicas)))


def _remember_sum(replicas: tuple[ReplicaAssignment, ...], exact: int) -> None:
    if len(_SUMS) >= _MAX_SUMS:
        evict(list(_SUMS.values()))  # freed off the decision's path (model.release_evicted)
        _SUMS.clear()  # atomic: a dry-run may plan in another thread
    _SUMS[id(replicas)] = (replicas, exact)


def _parts_of(outcomes: Mapping[int, ReplicaOutcome]) -> dict[int, Mapping[GpuKey, float]]:
    out = {}
    for i, o in outcomes.items():
        c = o.caps
        # a uniform part's emptiness from its GPU tuple (its len() is a Python call)
        if c.gpus if type(c) is UniformCaps else c:
            out[i] = c
    return out


def _with_identities(outcomes: Mapping[int, ReplicaOutcome], job: JobSpec) -> list[ReplicaAssignment]:
    """Every replica's assignment: its outcome's, else its identity (``_identity``,
    inlined: thousands of replicas each whole-job plan)."""
    t, batch = job.base_tp, job.local_batch
    memo = _IDENTITY
    out = []
    for i, spec in enumerate(job.replicas):
        o = outcomes.get(i)
        if o is not None:
            out.append(o.assignment)
            continue
        hit = memo.peek(spec)
        if hit is None or hit.index != i or hit.tp_degree != t or hit.local_batch != batch:
            hit = _build_identity(spec, i, t, batch)
            memo.put(spec, hit)
        out.append(hit)
    return out


def _outcome_or_identity(outcomes: Mapping[int, ReplicaOutcome], job: JobSpec, i: int) -> ReplicaAssignment:
    o = outcomes.get(i)
    return o.assignment if o is not None else _identity(job, i)


def _drafts(
    survey: Survey, job: JobSpec, pins: Mapping[int, int], full_degree: int, indices: Iterable[int]
) -> list[ReplicaDraft]:
    """A draft per replica of ``indices`` that may differ from the identity plan."""
    can_be_identity = full_degree == job.base_tp
    out = []
    replicas, clean = job.replicas, survey.clean_replica
    for i in indices:
        pin = pins.get(i)
        skip = can_be_identity and pin is None
        if skip and clean(replicas[i]):
            continue
        d = replica_draft(survey, i, replicas[i], pin, full_degree, none_if_clean=skip)
        if d is not None:
            out.append(d)
    return out


def _decide(eff: Policy, drafts: list[ReplicaDraft], cluster: ClusterState, job: JobSpec) -> None:
    if eff is Policy.SPARE:
        pool = spare_pool(cluster, job)
        for d in drafts:
            decide_spare(d, job, cluster, pool)
        return
    decide = _DECIDE[eff]
    for d in drafts:
        decide(d, job)


def _unheld_pins(drafts: list[ReplicaDraft], pins: Mapping[int, int]) -> list[SuspendedPin]:
    """Pins above the usable GPUs of a stage of their replica cannot hold now: the replica
    runs at what it has (the same degrees as unpinned), and the pin is reported (in the
    order of ``pins``)."""
    if not pins:
        return []
    by_index = {d.index: d for d in drafts}
    out: list[SuspendedPin] = []
    for r, t in pins.items():
        d = by_index.get(r)
        if d is None:  # not among the replicas planned now
            continue
        short = [s for s in d.stages if s.spare_for is None and len(s.usable) < t]
        if short:
            s = short[0]
            out.append(SuspendedPin(r, t, f"TP {t} needs {t} usable GPUs, rack {s.rack.name} has {len(s.usable)}"))
    return out


_IDENTITY: IdentityMemo[ReplicaAssignment] = IdentityMemo()


def _identity(job: JobSpec, index: int) -> ReplicaAssignment:
    """The failure-free assignment of replica ``index`` (memoised per replica spec)."""
    spec = job.replicas[index]
    t, batch = job.base_tp, job.local_batch
    hit = _IDENTITY.get(spec, lambda _: _build_identity(spec, index, t, batch))
    if hit.index == index and hit.tp_degree == t and hit.local_batch == batch:
        return hit
    return _build_identity(spec, index, t, batch)


def _build_identity(spec: ReplicaSpec, index: int, t: int, batch: int) -> ReplicaAssignment:
    if len(spec.stages) == 1:
        st = spec.stages[0]
        stages: tuple[StageAssignment, ...] = (StageAssignment(st.rack, t, st.gpus, 0),)
    else:
        stages = tuple(StageAssignment(st.rack, t, st.gpus, i) for i, st in enumerate(spec.stages))
    return ReplicaAssignment(index, ReplicaState.HEALTHY, stages, t, batch, 1.0, "healthy")


def _assign(
    d: ReplicaDraft, cluster: ClusterState, job: JobSpec, model: power.Curve
) -> tuple[ReplicaAssignment, Mapping[GpuKey, float]]:
    if d.state is ReplicaState.DROPPED:
        return ReplicaAssignment(d.index, d.state, (), 0, 0, 0.0, f"dropped: {d.why}"), {}
    caps: Mapping[GpuKey, float] = {}
    rels: list[float] = []
    pins, speeds = cluster.power_pins, cluster.gpu_speed
    full = full_tp(job)
    for s in d.stages:
        stage_caps = power.gpu_caps(s, pins)
        if pins or speeds:
            speed = power.stage_speed(s, stage_caps, speeds, model, pins)
        else:
            speed = power.plain_stage_speed(s, model)
        rels.append(min(1.0, s.degree * speed / full))
        if not caps:
            caps = stage_caps  # this stage's own map (the common single stage)
        elif stage_caps:
            caps = {**caps, **stage_caps}
    rel = min(rels)
    batch = max(1, math.floor(job.local_batch * rel + 1e-9))
    stages = tuple(StageAssignment(s.rack.name, s.degree, s.used, s.spec_index) for s in d.stages)
    tp = min(s.degree for s in d.stages)
    state = d.state
    if state is ReplicaState.HEALTHY and rel < 1.0 - 1e-12:
        state = ReplicaState.DEGRADED
    if state is ReplicaState.HEALTHY:
        why = "healthy"
    else:
        key = ("why", state, tp, rel)
        why = model.text.get(key)
        if why is None:
            why = model.text[key] = f"{_STATE_NAMES[state]}: TP {tp}, {rel:.3f}x throughput"
        if d.fallback:
            why = f"{why}, {d.fallback}"
    return ReplicaAssignment(d.index, state, stages, tp, batch, rel, why), caps
