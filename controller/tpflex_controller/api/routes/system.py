"""Liveness, readiness, metrics and the one-call cluster status."""

from __future__ import annotations

import asyncio
import threading
import time

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from tpflex_proto import keys
from tpflex_proto.etcd import EtcdError

from tpflex_controller.api import schemas as s
from tpflex_controller.api.deps import Deps
from tpflex_controller.api.errors import ApiError, ErrorCode, error_response
from tpflex_controller.api.routes.racks import unassigned_nodes
from tpflex_controller.api.rows import STATES

probes = APIRouter(tags=["system"])
status_router = APIRouter(tags=["system"])

_NOT_READY = {503: {"model": s.ErrorBody, "description": "etcd unreachable or no leader"}}
PROBE_TIMEOUT_S = 1.0  # readiness asks etcd itself, this long at most ...
PROBE_TTL_S = 1.0  # ... and at most this often per API process


class _EtcdProbe:
    """Whether etcd answers a linearizable read (it needs a raft leader and a quorum),
    asked at most every PROBE_TTL_S. The watch-fed view alone cannot say: a leaderless or
    frozen etcd keeps its watch streams open and silent, which looks like a quiet
    cluster (readiness said ready for the whole of a quorum loss)."""

    def __init__(self, etcd) -> None:
        self._etcd = etcd
        self._lock = threading.Lock()
        self._at = -float("inf")
        self._problem: str | None = None

    def problem(self) -> str | None:
        with self._lock:
            if time.monotonic() - self._at >= PROBE_TTL_S:
                try:
                    self._etcd.answers(keys.LEADER, PROBE_TIMEOUT_S)
                    self._problem = None
                except EtcdError as exc:
                    self._problem = str(exc)
                self._at = time.monotonic()
            return self._problem


def _probe(deps) -> _EtcdProbe:
    probe = getattr(deps, "_etcd_probe", None)
    if probe is None:
        probe = deps._etcd_probe = _EtcdProbe(deps.etcd)
    return probe


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
    problem = await asyncio.to_thread(_probe(deps).problem)
    if problem is not None:
        return error_response(ErrorCode.ETCD_UNAVAILABLE, f"not ready: etcd does not answer ({problem})")
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
        unassigned_nodes=unassigned_nodes(reads.cluster()),
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
