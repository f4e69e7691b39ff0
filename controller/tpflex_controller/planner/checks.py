"""The planner's checks of a job spec and of the operator's TP pins (pure): a bad spec
raises ``PlanningError``; a pin that cannot hold is suspended, not raised."""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain
from operator import attrgetter

from tpflex_controller.planner.model import (
    ClusterState,
    JobOverrides,
    JobSpec,
    PlanningError,
    SuspendedPin,
    full_tp,
)


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
    if not _stages_fit(cluster, job):
        _stage_problem(cluster, job)
    return full_tp(job)


def _stages_fit(cluster: ClusterState, job: JobSpec) -> bool:
    """Whether every replica has stages, each on a known rack with ``base_tp`` GPUs (the
    checks of ``_stage_problem``, iterated in C: thousands of replicas each plan)."""
    stages_of = list(map(_stages_of, job.replicas))
    if not all(stages_of):
        return False
    stages = list(chain.from_iterable(stages_of))
    return cluster.racks.keys() >= set(map(_rack_of, stages)) and set(
        map(len, map(_gpus_of, stages))
    ) == {job.base_tp}


_stages_of, _rack_of, _gpus_of = attrgetter("stages"), attrgetter("rack"), attrgetter("gpus")


def _stage_problem(cluster: ClusterState, job: JobSpec) -> None:
    """Raise the first stage problem of the spec, in replica order."""
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


def valid_pins(
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
