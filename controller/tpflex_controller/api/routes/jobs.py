"""Jobs: spec + current plan + acks, plan history, spec change and deletion (admin),
forced reconfiguration, dry-run."""

from __future__ import annotations

import dataclasses
from typing import Annotated

from fastapi import APIRouter, Body, Request
from fastapi.responses import Response
from tpflex_proto import keys, types_pb2

from tpflex_controller import convert, plandiff
from tpflex_controller.api import schemas as s
from tpflex_controller.api import views
from tpflex_controller.api.checks import check_gpus_exist, check_pins
from tpflex_controller.api.deps import Admin, ApiDeps, Deps, check_job_limit
from tpflex_controller.api.errors import ApiError, ErrorCode, invalid, not_found
from tpflex_controller.api.paging import After, PageLimit, page
from tpflex_controller.api.params import JobName, Limit
from tpflex_controller.api.state import job_spec, planner_job
from tpflex_controller.planner import plan
from tpflex_controller.planner.model import GpuStatus, JobOverrides
from tpflex_controller.spec_checks import InputError, check_spec, spec_difference
from tpflex_controller.store import RequiredKeyGone, decode_or_skip

router = APIRouter(prefix="/jobs", tags=["jobs"])


@router.get("", response_model=list[s.JobView], summary="List jobs with their current plan (paginated)")
def list_jobs(deps: Deps, request: Request, response: Response, limit: PageLimit = None,
               after: After = None) -> list[s.JobView]:
    reads = deps.reads
    jobs = reads.jobs()
    return [
        views.job_view(jobs[name], reads.plan(name), reads.job_override(name), reads.acks(name),
                       _goodput(deps, name))
        for name in page(sorted(jobs), str, limit, after, request, response)
    ]


def _goodput(deps, job: str):
    return deps.steps.goodput(job) if deps.steps is not None else None


@router.get("/{job}", response_model=s.JobView, summary="One job: spec, plan summary, acks")
def get_job(job: JobName, deps: Deps) -> Response:
    """The view serialised once, by pydantic (the route built it valid: FastAPI's
    validation and encoding of the returned model again took most of a miss's CPU)."""
    reads = deps.reads
    spec = job_spec(reads, job)
    view = views.job_view(spec, reads.plan(job), reads.job_override(job), reads.acks(job),
                          _goodput(deps, job))
    return Response(content=view.model_dump_json(), media_type="application/json")


@router.get("/{job}/plan", response_model=s.PlanView, summary="The job's current plan")
def get_plan(job: JobName, deps: Deps) -> Response:
    job_spec(deps.reads, job)
    plan = deps.reads.plan(job)
    if plan is None:
        raise not_found(f"job {job!r} has no committed plan yet")
    return deps.memo.json("plan", job, plan, lambda: views.plan_json(plan))


@router.get("/{job}/plans", response_model=s.PlanHistory, summary="Plan history, oldest first")
def plan_history(
    job: JobName, deps: Deps, limit: Limit = 100
) -> s.PlanHistory:
    job_spec(deps.reads, job)
    plans = deps.reads.plan_history(job, limit)
    return s.PlanHistory(job=job, plans=[views.plan_view(p) for p in plans])


@router.put(
    "/{job}/spec", response_model=s.SpecChangeResult, status_code=202,
    summary="Change a registered job's spec (admin); checked as RegisterJob checks a new one",
)
def change_spec(job: JobName, body: s.JobSpecRequest, deps: Deps, caller: Admin) -> s.SpecChangeResult:
    check_job_limit(caller, job)
    for _attempt in range(5):
        guard = deps.store.spec_guard_revision()
        kv = deps.etcd.get(keys.job_spec(job))
        old = decode_or_skip(types_pb2.JobSpec, kv) if kv is not None else None
        if old is None:
            raise not_found(f"job {job!r} not found (a new job is registered by its trainers)")
        spec = spec_from_request(job, body, old.created_at)
        if not spec_difference(old, spec):
            deps.settle(kv.mod_revision)  # what the client reads next is the stored spec
            return s.SpecChangeResult(job=job, changed=False)
        _checked(spec, deps)
        if revision := deps.store.write_spec(job, spec, spec_revision=kv.mod_revision, guard_revision=guard):
            deps.settle(revision)
            return s.SpecChangeResult(job=job, changed=True)
    raise ApiError(ErrorCode.CONFLICT, f"job specs kept changing while job {job!r} was checked; retry")


@router.delete(
    "/{job}", response_model=s.JobDeleted, status_code=202,
    summary="Delete a job (admin): its spec, override and acks; the leader removes its plan",
)
def delete_job(job: JobName, deps: Deps, caller: Admin) -> s.JobDeleted:
    check_job_limit(caller, job)
    for _attempt in range(5):
        guard = deps.store.spec_guard_revision()
        kv = deps.etcd.get(keys.job_spec(job))
        if kv is None:
            raise not_found(f"job {job!r} not found")
        if revision := deps.store.write_spec(job, None, spec_revision=kv.mod_revision, guard_revision=guard):
            deps.settle(revision)
            return s.JobDeleted(job=job)
    raise ApiError(ErrorCode.CONFLICT, f"job specs kept changing while job {job!r} was deleted; retry")


def spec_from_request(job: str, body: s.JobSpecRequest, created_at: float) -> types_pb2.JobSpec:
    spec = types_pb2.JobSpec(
        name=job, base_tp=body.base_tp, min_tp=body.min_tp, spare_racks=body.spare_racks,
        policy=body.policy.value if body.policy is not None else "", global_batch=body.global_batch,
        local_batch=body.local_batch, created_at=created_at,
        units=[types_pb2.UnitFamily(name=u.name, count=u.count, bytes_per_unit=u.bytes_per_unit)
               for u in body.units],
    )
    if body.model is not None:
        m = body.model
        spec.model.CopyFrom(types_pb2.ModelUnits(
            model_type=m.model_type, config_sha256=m.config_sha256, base_tp=m.base_tp,
            units=[types_pb2.UnitFamily(name=u.name, count=u.count, bytes_per_unit=u.bytes_per_unit)
                   for u in m.units]))
    for rep in body.replicas:
        spec.replicas.add(stages=[
            types_pb2.StageSpec(rack=st.rack, ranks=[types_pb2.GpuRef(node=g.node, index=g.index)
                                                     for g in st.ranks])
            for st in rep.stages
        ])
    return spec


def _checked(spec: types_pb2.JobSpec, deps: ApiDeps) -> None:
    try:
        check_spec(spec, deps.store.racks(), deps.store.job_specs())
    except InputError as exc:
        raise ApiError(ErrorCode.CONFLICT if exc.kind == "conflict" else ErrorCode.INVALID_REQUEST,
                       exc.message) from None


@router.post(
    "/{job}/reconfigure", response_model=s.ReconfigureResult, status_code=202,
    summary="Pin replicas' TP degrees and/or switch the policy (writes the job override)",
)
def reconfigure(job: JobName, body: s.ReconfigureRequest, deps: Deps, caller: Admin) -> s.ReconfigureResult:
    check_job_limit(caller, job)
    spec = job_spec(deps.reads, job)
    if not body.pins and body.policy is None and not body.clear:
        raise invalid("nothing to do: give pins, a policy, or clear=true")
    snap = deps.reads.cluster()
    model = planner_job(spec, snap)
    pins = check_pins(model, ((p.replica, p.tp_degree) for p in body.pins), convert.cluster_state(snap))
    try:  # only while the spec exists: an override written after a delete would outlive the job
        _, new, revision = deps.store.update(
            keys.job_override(job), types_pb2.JobOverride,
            lambda old: merged_override(job, None if body.clear else old, pins, body, deps.clock(),
                                        by=caller.name),
            requires=keys.job_spec(job),
        )
    except RequiredKeyGone:
        raise not_found(f"job {job!r} not found (deleted meanwhile)") from None
    deps.settle(revision)
    return s.ReconfigureResult(override=views.override_view(new))


def merged_override(
    job: str, old: types_pb2.JobOverride | None, pins: dict[int, int], body: s.ReconfigureRequest,
    at: float, by: str = "",
) -> types_pb2.JobOverride | None:
    """The job override after a reconfigure: the stored pins with the new ones on top, the
    new policy or the stored one; None (no override) when nothing is left. ``by``: the
    operator who asked (the token's name)."""
    merged = {p.replica: p.tp_degree for p in old.pins} if old else {}
    merged.update(pins)
    policy = body.policy.value if body.policy is not None else (old.policy if old else "")
    if not merged and not policy:
        return None
    return types_pb2.JobOverride(
        job=job, policy=policy, reason=body.reason or (old.reason if old else ""), at=at, by=by,
        pins=[types_pb2.ReplicaPin(replica=r, tp_degree=t) for r, t in sorted(merged.items())],
    )


@router.post(
    "/{job}/dry-run", response_model=s.DryRunResult,
    summary="Plan the job as if these GPUs failed; commits nothing",
)
def dry_run(
    job: JobName, deps: Deps, body: Annotated[s.DryRunRequest | None, Body()] = None
) -> s.DryRunResult:
    body = body or s.DryRunRequest()
    spec = job_spec(deps.reads, job)
    snap = deps.reads.cluster()
    model = planner_job(spec, snap)
    failed = check_gpus_exist(((g.node, g.index) for g in body.fail), views.gpu_locations(snap))
    state = convert.cluster_state(snap)
    status = dict(state.gpu_status)
    status.update({g: GpuStatus.FAILED for g in failed})
    state = dataclasses.replace(state, gpu_status=status)
    overrides = JobOverrides() if body.ignore_overrides else _job_overrides(deps, job)
    if body.pins:
        pins = check_pins(model, ((p.replica, p.tp_degree) for p in body.pins), state)
        overrides = dataclasses.replace(overrides, pins={**overrides.pins, **pins})
    result = _planner(deps)(
        state, model, policy=body.policy, power_model=deps.power_model, overrides=overrides,
        now=deps.clock(),
    )
    current = deps.reads.plan(job)
    proposed = convert.plan_to_proto(result, 0, cause="dry-run")
    return s.DryRunResult(
        job=job,
        failed_gpus=[s.GpuRefView(node=n, index=i) for n, i in failed],
        current_generation=current.generation if current else None,
        current_expected_throughput_ratio=current.expected_throughput_ratio if current else None,
        plan=views.plan_decision(proposed),
        changes=[views.change_view(c) for c in plandiff.diff(current, proposed)],
    )


def _job_overrides(deps: ApiDeps, job: str) -> JobOverrides:
    try:
        return convert.job_overrides(deps.reads.job_override(job))
    except ValueError:  # an unknown stored policy: plan as if there were no override
        return JobOverrides()


def _planner(deps: ApiDeps):
    return deps.planner if deps.planner is not None else plan
