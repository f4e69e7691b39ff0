"""Jobs: spec + current plan + acks, plan history, forced reconfiguration, dry-run."""

from __future__ import annotations

import dataclasses
from typing import Annotated

from fastapi import APIRouter, Body, Path, Query, Request
from fastapi.responses import Response
from tpflex_proto import types_pb2

from tpflex_controller import convert, plandiff
from tpflex_controller.api import schemas as s
from tpflex_controller.api import views
from tpflex_controller.api.checks import check_gpus_exist, check_pins
from tpflex_controller.api.deps import Admin, ApiDeps, Deps
from tpflex_controller.api.errors import invalid, not_found
from tpflex_controller.api.paging import After, Limit, page
from tpflex_controller.api.state import job_spec, planner_job
from tpflex_controller.planner import plan
from tpflex_controller.planner.model import GpuStatus, JobOverrides

router = APIRouter(prefix="/jobs", tags=["jobs"])

JobName = Annotated[str, Path(min_length=1, max_length=253)]


@router.get("", response_model=list[s.JobView], summary="List jobs with their current plan (paginated)")
async def list_jobs(deps: Deps, request: Request, response: Response, limit: Limit = None,
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
async def get_job(job: JobName, deps: Deps) -> s.JobView:
    reads = deps.reads
    spec = job_spec(reads, job)
    return views.job_view(spec, reads.plan(job), reads.job_override(job), reads.acks(job),
                          _goodput(deps, job))


@router.get("/{job}/plan", response_model=s.PlanView, summary="The job's current plan")
async def get_plan(job: JobName, deps: Deps) -> Response:
    job_spec(deps.reads, job)
    plan = deps.reads.plan(job)
    if plan is None:
        raise not_found(f"job {job!r} has no committed plan yet")
    return deps.memo.json("plan", job, plan, lambda: views.plan_view(plan))


@router.get("/{job}/plans", response_model=s.PlanHistory, summary="Plan history, oldest first")
def plan_history(
    job: JobName, deps: Deps, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> s.PlanHistory:
    job_spec(deps.reads, job)
    plans = deps.reads.plan_history(job, limit)
    return s.PlanHistory(job=job, plans=[views.plan_view(p) for p in plans])


@router.post(
    "/{job}/reconfigure", response_model=s.ReconfigureResult, status_code=202,
    summary="Pin replicas' TP degrees and/or switch the policy (writes the job override)",
)
def reconfigure(job: JobName, body: s.ReconfigureRequest, deps: Deps, _: Admin) -> s.ReconfigureResult:
    spec = job_spec(deps.reads, job)
    if not body.pins and body.policy is None and not body.clear:
        raise invalid("nothing to do: give pins, a policy, or clear=true")
    snap = deps.reads.cluster()
    model = planner_job(spec, snap)
    pins = check_pins(model, ((p.replica, p.tp_degree) for p in body.pins), convert.cluster_state(snap))
    old = None if body.clear else deps.store.job_override(job)  # etcd now, not the view
    merged = {p.replica: p.tp_degree for p in old.pins} if old else {}
    merged.update(pins)
    policy = body.policy.value if body.policy is not None else (old.policy if old else "")
    if not merged and not policy:
        deps.store.delete_job_override(job)
        return s.ReconfigureResult(override=None)
    override = types_pb2.JobOverride(
        job=job, policy=policy, reason=body.reason or (old.reason if old else ""), at=deps.clock(),
        pins=[types_pb2.ReplicaPin(replica=r, tp_degree=t) for r, t in sorted(merged.items())],
    )
    deps.store.put_job_override(override)
    return s.ReconfigureResult(override=views.override_view(override))


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
