"""Liveness, readiness, metrics and the one-call cluster status."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from tpflex_proto.etcd import EtcdError

from tpflex_controller.api import schemas as s
from tpflex_controller.api.deps import Deps
from tpflex_controller.api.errors import ApiError, ErrorCode, error_response
from tpflex_controller.api.rows import STATES

probes = APIRouter(tags=["system"])
status_router = APIRouter(tags=["system"])

_NOT_READY = {503: {"model": s.ErrorBody, "description": "etcd unreachable or no leader"}}


@probes.get("/healthz", response_model=s.Health, summary="Liveness: the process serves")
async def healthz() -> s.Health:
    return s.Health(status="ok")


@probes.get("/readyz", response_model=s.Health, responses=_NOT_READY, summary="Readiness")
async def readyz(deps: Deps) -> s.Health | JSONResponse:
    try:
        record = deps.reads.leader()
    except EtcdError as exc:
        return error_response(ErrorCode.ETCD_UNAVAILABLE, f"not ready: etcd unreachable ({exc})")
    except ApiError as exc:  # the watch-fed view is not synced or lost etcd
        return error_response(ErrorCode.ETCD_UNAVAILABLE, f"not ready: {exc.message}")
    if record is None:
        return error_response(ErrorCode.NOT_READY, "not ready: no controller leader is elected")
    return s.Health(status="ready", leader=record.id)


@probes.get(
    "/metrics", response_class=Response, summary="Prometheus metrics",
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}},
)
def metrics(deps: Deps) -> Response:
    head = deps.metrics_prefix() if deps.metrics_prefix is not None else b""
    return Response(head + generate_latest(deps.registry), media_type=CONTENT_TYPE_LATEST)


@status_router.get("/status", response_model=s.StatusView, summary="Cluster summary")
def status(deps: Deps) -> Response:
    reads = deps.reads
    nodes, live, counts = reads.status_counts()  # O(changes) from the watch-fed cache
    record = reads.leader()
    jobs = []
    for name, spec in sorted(reads.jobs().items()):
        plan = reads.plan(name)
        # kept per (spec, plan) object: a plan's replicas are walked once, not per request
        jobs.append(deps.memo.value("status", name, (spec, plan), lambda name=name, spec=spec, plan=plan:
                                    _job_status(name, spec, plan)))
    view = s.StatusView(
        leader=s.LeaderView(id=record.id, address=record.address, since=record.since) if record else None,
        etcd_revision=reads.revision(),
        racks=reads.rack_count(), nodes=nodes, live_nodes=live,
        gpus=s.GpuStateCounts(total=sum(counts), **dict(zip(STATES, counts, strict=True))), jobs=jobs,
    )
    # serialised once (a status always misses the response cache: it shows the revision)
    return Response(content=view.model_dump_json(), media_type="application/json")


def _job_status(name: str, spec, plan) -> s.JobStatus:
    return s.JobStatus(
        name=name, generation=plan.generation if plan else None,
        policy=plan.policy if plan else (spec.policy or "ntp-pw"),
        expected_throughput_ratio=plan.expected_throughput_ratio if plan else None,
        replica_tp_degrees=[r.tp_degree for r in plan.replicas] if plan else [],
        suspended_pins=len(plan.suspended_pins) if plan else 0,
    )
