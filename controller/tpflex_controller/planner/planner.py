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
from collections.abc import Mapping

from tpflex_proto.powermodel import DEFAULT_POWER_MODEL, PowerModel

from tpflex_controller.planner import power
from tpflex_controller.planner.memo import IdentityMemo
from tpflex_controller.planner.model import (
    ClusterState,
    GpuKey,
    JobOverrides,
    JobSpec,
    PlanningError,
    PlanResult,
    Policy,
    ReplicaAssignment,
    ReplicaSpec,
    ReplicaState,
    StageAssignment,
    SuspendedPin,
)
from tpflex_controller.planner.reasons import replica_reasons
from tpflex_controller.planner.stages import (
    ReplicaDraft,
    decide_dp_drop,
    decide_ntp,
    decide_ntp_pw,
    decide_spare,
    replica_clean,
    replica_draft,
    spare_pool,
    touched_gpus,
    unusable_gpus,
)

_NO_OVERRIDES = JobOverrides()
_DECIDE = {Policy.NTP_PW: decide_ntp_pw, Policy.NTP: decide_ntp, Policy.DP_DROP: decide_dp_drop}


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
    leaves the plan."""
    overrides = overrides or _NO_OVERRIDES
    eff = Policy(policy or overrides.policy or job.policy)
    model = power_model or DEFAULT_POWER_MODEL
    full_degree = validate(cluster, job)
    pins, suspended = _valid_pins(job, overrides.pins, full_degree)
    drafts = _decided_drafts(eff, cluster, job, pins, full_degree)
    unheld = _unheld_pins(drafts, pins)
    if unheld:  # plan those replicas again as if unpinned (pins never change spare moves)
        gone = {p.replica for p in unheld}
        pins = {r: t for r, t in pins.items() if r not in gone}
        drafts = _decided_drafts(eff, cluster, job, pins, full_degree)
        suspended += unheld
    changed = [d for d in drafts if d is not None]
    if eff is Policy.NTP_PW:
        power.plan_boosts(
            (s for d in changed if d.state is not ReplicaState.DROPPED for s in d.stages),
            cluster,
            job.base_tp,
            model,
        )
    replicas, caps, reasons = _assemble(drafts, cluster, job, eff, model)
    ratio = sum(r.relative_throughput for r in replicas) / len(replicas)
    reasons += tuple(f"replica {p.replica}: operator pin suspended: {p.reason}" for p in suspended)
    return PlanResult(job.name, eff, replicas, caps, ratio, reasons, tuple(sorted(suspended)))


def _drafts(
    cluster: ClusterState, job: JobSpec, pins: Mapping[int, int], full_degree: int
) -> list[ReplicaDraft | None]:
    """A draft per replica that may differ from the identity plan; None for the others."""
    touched = touched_gpus(cluster)
    unusable = unusable_gpus(cluster)
    live = cluster.live_nodes
    can_be_identity = full_degree == job.base_tp
    return [
        None
        if can_be_identity and i not in pins and replica_clean(rep, touched, live)
        else replica_draft(cluster, job, i, rep, touched, unusable, pins.get(i), full_degree)
        for i, rep in enumerate(job.replicas)
    ]


def _decided_drafts(
    eff: Policy, cluster: ClusterState, job: JobSpec, pins: Mapping[int, int], full: int
) -> list[ReplicaDraft | None]:
    drafts = _drafts(cluster, job, pins, full)
    _decide(eff, [d for d in drafts if d is not None], cluster, job)
    return drafts


def _decide(eff: Policy, drafts: list[ReplicaDraft], cluster: ClusterState, job: JobSpec) -> None:
    if eff is Policy.SPARE:
        pool = spare_pool(cluster, job)
        for d in drafts:
            decide_spare(d, job, cluster, pool)
        return
    decide = _DECIDE[eff]
    for d in drafts:
        decide(d, job)


def validate(cluster: ClusterState, job: JobSpec, overrides: JobOverrides | None = None) -> int:
    """Check the spec (not its pins, which ``plan`` suspends when they cannot hold); returns
    the full degree (base TP capped by the smallest unit count). ``overrides`` is ignored
    (kept for callers of the old signature)."""
    if job.base_tp < 1:
        raise PlanningError(f"job {job.name}: base TP degree must be >= 1, got {job.base_tp}")
    if not 1 <= job.min_tp <= job.base_tp:
        raise PlanningError(f"job {job.name}: min_tp {job.min_tp} must be in 1..{job.base_tp}")
    if not job.replicas:
        raise PlanningError(f"job {job.name}: has no replicas")
    if job.local_batch < 1:
        raise PlanningError(f"job {job.name}: local batch must be >= 1, got {job.local_batch}")
    bad_units = [f"{k}={v}" for k, v in job.units.items() if v < 1]
    if bad_units:
        raise PlanningError(f"job {job.name}: unit counts must be >= 1 ({', '.join(bad_units)})")
    for name in job.spare_racks:
        if name not in cluster.racks:
            raise PlanningError(f"job {job.name}: spare rack {name!r} is unknown")
    for i, rep in enumerate(job.replicas):
        if not rep.stages:
            raise PlanningError(f"job {job.name}: replica {i} has no stages")
        for s_idx, st in enumerate(rep.stages):
            if st.rack not in cluster.racks:
                raise PlanningError(f"job {job.name}: replica {i} stage {s_idx} names unknown rack {st.rack!r}")
            if len(st.gpus) != job.base_tp:
                raise PlanningError(
                    f"job {job.name}: replica {i} stage {s_idx} has {len(st.gpus)} ranks, "
                    f"base TP degree is {job.base_tp}"
                )
    return min(job.base_tp, *job.units.values()) if job.units else job.base_tp


def pin_problem(job: JobSpec, replica: int, degree: int, full: int) -> str | None:
    """Why a TP pin is invalid for the spec (None when it is valid)."""
    if not 0 <= replica < len(job.replicas):
        return f"no such replica (job has {len(job.replicas)})"
    if degree < 1:
        return "a TP degree must be >= 1"
    if degree > job.base_tp:
        return f"TP {degree} is above the base TP degree {job.base_tp}"
    if degree < job.min_tp:
        return f"TP {degree} is below min_tp {job.min_tp}"
    if degree > full:
        smallest = min(job.units, key=job.units.__getitem__)
        return f"TP {degree} leaves a rank with no units ({smallest} has {job.units[smallest]})"
    return None


def _valid_pins(
    job: JobSpec, pins: Mapping[int, int], full: int
) -> tuple[dict[int, int], list[SuspendedPin]]:
    valid: dict[int, int] = {}
    suspended: list[SuspendedPin] = []
    for r, t in pins.items():
        why = pin_problem(job, r, t, full)
        if why is None:
            valid[r] = t
        else:
            suspended.append(SuspendedPin(r, t, why))
    return valid, suspended


def _unheld_pins(drafts: list[ReplicaDraft | None], pins: Mapping[int, int]) -> list[SuspendedPin]:
    """Pins above the usable GPUs of a stage of their replica cannot hold now: the replica
    runs at what it has (the same degrees as unpinned), and the pin is reported."""
    out: list[SuspendedPin] = []
    for r, t in pins.items():
        d = drafts[r]
        assert d is not None  # pinned replicas always get a draft
        short = [s for s in d.stages if s.spare_for is None and len(s.usable) < t]
        if short:
            s = short[0]
            out.append(SuspendedPin(r, t, f"TP {t} needs {t} usable GPUs, rack {s.rack.name} has {len(s.usable)}"))
    return out


def _assemble(
    drafts: list[ReplicaDraft | None],
    cluster: ClusterState,
    job: JobSpec,
    eff: Policy,
    model: PowerModel,
) -> tuple[tuple[ReplicaAssignment, ...], dict[GpuKey, float], tuple[str, ...]]:
    replicas: list[ReplicaAssignment] = []
    caps: dict[GpuKey, float] = {}
    reasons: list[str] = []
    for i, d in enumerate(drafts):
        if d is None:
            replicas.append(_identity(job, i))
            continue
        assignment, stage_caps = _assign(d, cluster, job, model)
        replicas.append(assignment)
        caps.update(stage_caps)
        reasons.extend(
            replica_reasons(
                d, assignment, job, eff, stage_caps, cluster.gpu_speed, cluster.power_pins, model
            )
        )
    return tuple(replicas), caps, tuple(reasons)


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
    stages = tuple(StageAssignment(st.rack, t, st.gpus, i) for i, st in enumerate(spec.stages))
    return ReplicaAssignment(index, ReplicaState.HEALTHY, stages, t, batch, 1.0, "healthy")


def _assign(
    d: ReplicaDraft, cluster: ClusterState, job: JobSpec, model: PowerModel
) -> tuple[ReplicaAssignment, dict[GpuKey, float]]:
    if d.state is ReplicaState.DROPPED:
        return ReplicaAssignment(d.index, d.state, (), 0, 0, 0.0, f"dropped: {d.why}"), {}
    caps: dict[GpuKey, float] = {}
    rels: list[float] = []
    for s in d.stages:
        stage_caps = power.gpu_caps(s, cluster.power_pins)
        speed = power.stage_speed(s, stage_caps, cluster.gpu_speed, model)
        rels.append(min(1.0, s.degree * speed / job.base_tp))
        caps.update(stage_caps)
    rel = min(rels)
    batch = max(1, math.floor(job.local_batch * rel + 1e-9))
    stages = tuple(StageAssignment(s.rack.name, s.degree, s.used, s.spec_index) for s in d.stages)
    tp = min(s.degree for s in d.stages)
    state = d.state
    if state is ReplicaState.HEALTHY and rel < 1.0 - 1e-12:
        state = ReplicaState.DEGRADED
    why = "healthy" if state is ReplicaState.HEALTHY else f"{state.value}: TP {tp}, {rel:.3f}x throughput"
    return ReplicaAssignment(d.index, state, stages, tp, batch, rel, why), caps
