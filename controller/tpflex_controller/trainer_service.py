"""The controller's trainer-facing gRPC service (``Trainer`` of controller.proto).

Every controller replica serves it, reading and writing etcd directly (no leader needed):
``RegisterJob`` validates and stores a job spec, ``WatchPlan`` streams a job's plan
generations (one shared etcd watch per job, fanned out to the streams), ``AckPlan``
records a rank's ack, ``ReportStep`` feeds the in-memory step window (goodput).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent import futures

import grpc
from tpflex_proto import codec, controller_pb2, controller_pb2_grpc, keys, types_pb2
from tpflex_proto.etcd import Cmp, Etcd, EtcdError, EtcdUnavailable, Op
from tpflex_proto.tls import ServerTls, bind_grpc

from tpflex_controller import convert
from tpflex_controller.cache import decode_plan
from tpflex_controller.planfeed import PlanFeed
from tpflex_controller.planner.model import ClusterState, PlanningError
from tpflex_controller.planner.planner import validate
from tpflex_controller.rendezvous import RendezvousLimits, add_rendezvous
from tpflex_controller.steps import StepStats
from tpflex_controller.store import Store

log = logging.getLogger(__name__)


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


_job_name_ok = keys.job_name_ok


def validate_job(spec: types_pb2.JobSpec, racks: dict[str, types_pb2.Rack]) -> None:
    """Raise PlanningError (message says why) for a spec the planner cannot plan."""
    if not _job_name_ok(spec.name):
        raise PlanningError("job name must be 1-128 printable characters without '/'")
    infos = {name: convert.rack_info(r) for name, r in racks.items()}
    try:
        job = convert.job_spec(spec, infos)
    except ValueError as exc:  # PlanningError or an unknown policy
        raise PlanningError(str(exc)) from None
    validate(ClusterState(racks=infos), job, convert.job_overrides(None))
    for r_idx, rep in enumerate(job.replicas):
        for s_idx, st in enumerate(rep.stages):
            known = set(infos[st.rack].gpus)
            missing = [g for g in st.gpus if g not in known]
            if missing:
                raise PlanningError(
                    f"job {spec.name}: replica {r_idx} stage {s_idx} names GPU "
                    f"{missing[0][0]}:{missing[0][1]}, which is not in rack {st.rack}"
                )


def _same_spec(a: types_pb2.JobSpec, b: types_pb2.JobSpec) -> bool:
    x, y = types_pb2.JobSpec(), types_pb2.JobSpec()
    x.CopyFrom(a)
    y.CopyFrom(b)
    x.ClearField("created_at")
    y.ClearField("created_at")
    return codec.encode(x) == codec.encode(y)


def replay_plans(
    job: str, after: int, current: types_pb2.Plan, history: list[types_pb2.Plan]
) -> list[types_pb2.Plan]:
    """Generations (after, current.generation] from ``history`` (any order), then the
    current plan; when the history no longer holds generation after+1, logs it and
    returns the current plan alone."""
    missed = sorted(
        (p for p in history if after < p.generation < current.generation),
        key=lambda p: p.generation,
    )
    have = {p.generation for p in history} | {current.generation}
    if after + 1 not in have:
        oldest = min(have)
        log.warning(
            "plan replay older than history job=%s after_generation=%d oldest_kept=%d current=%d",
            job, after, oldest, current.generation,
        )
        return [current]
    if missed:
        log.info("plan replay job=%s after_generation=%d generations=%d current=%d",
                 job, after, len(missed) + 1, current.generation)
    return [*missed, current]


class TrainerServicer(controller_pb2_grpc.TrainerServicer):
    def __init__(self, etcd: Etcd, *, steps: StepStats, clock: Callable[[], float] = time.time):
        self.etcd = etcd
        self.store = Store(etcd)
        self.steps = steps
        self.clock = clock
        self.feed = PlanFeed(etcd)

    # ---- helpers ----

    def _run(self, context, fn, *args):
        try:
            return fn(*args)
        except _Abort as exc:
            context.abort(exc.code, exc.message)
        except EtcdUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd unavailable: {exc}")
        except EtcdError as exc:
            context.abort(grpc.StatusCode.INTERNAL, f"etcd error: {exc}")

    def _plan(self, job: str) -> types_pb2.Plan | None:
        kv = self.etcd.get(keys.job_plan(job))
        if kv is None:
            return None
        try:
            return decode_plan(kv.value, kv.key)
        except codec.MalformedValue as exc:
            log.warning("skipping malformed etcd value key=%s error=%s", kv.key, exc)
            return None

    def _require_job(self, job: str) -> types_pb2.JobSpec:
        if not _job_name_ok(job):
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "job must be a job name (1-128 characters, no '/')")
        spec = self.store.job(job)
        if spec is None:
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"unknown job {job!r}")
        return spec

    # ---- RPCs ----

    def RegisterJob(self, request, context):
        return self._run(context, self._register, request.spec)

    def _register(self, spec: types_pb2.JobSpec) -> controller_pb2.RegisterJobResponse:
        try:
            validate_job(spec, self.store.racks())
        except PlanningError as exc:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        key = keys.job_spec(spec.name)
        current = self.etcd.get(key)
        if current is not None:
            existing = self.store.job(spec.name)
            if existing is not None and _same_spec(existing, spec):
                return controller_pb2.RegisterJobResponse(plan=self._plan(spec.name))
        stored = types_pb2.JobSpec()
        stored.CopyFrom(spec)
        stored.created_at = spec.created_at or self.clock()
        rev = current.mod_revision if current is not None else 0
        res = self.etcd.txn([Cmp.mod_revision(key, "==", rev)], [Op.put(key, codec.encode(stored))])
        if not res.succeeded:
            raise _Abort(grpc.StatusCode.ABORTED, f"job {spec.name} was re-registered concurrently; retry")
        log.info("job registered job=%s replicas=%d base_tp=%d", spec.name, len(spec.replicas), spec.base_tp)
        return controller_pb2.RegisterJobResponse(plan=self._plan(spec.name))

    def WatchPlan(self, request, context):
        try:
            self._require_job(request.job)
        except _Abort as exc:
            context.abort(exc.code, exc.message)
        except EtcdError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd unavailable: {exc}")
        try:
            sub = self.feed.subscribe(request.job)
        except EtcdError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd unavailable: {exc}")
        context.add_callback(sub.close)
        try:
            last = request.after_generation
            try:
                backlog = self._backlog(request.job, last)
            except EtcdError as exc:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd unavailable: {exc}")
            for plan in backlog:
                if plan.generation > last:
                    last = plan.generation
                    yield plan
            while context.is_active() and not sub.closed:
                plan = sub.get(timeout=1.0)
                if plan is not None and plan.generation > last:
                    last = plan.generation
                    yield plan
        finally:
            self.feed.unsubscribe(sub)

    def _backlog(self, job: str, after: int) -> list[types_pb2.Plan]:
        """What a stream resuming after generation ``after`` missed, oldest first: every
        committed generation in (after, current] from the job's plan history, or the
        current plan alone when ``after`` is 0 or older than the history keeps."""
        current = self._plan(job)
        if current is None or current.generation <= after:
            return []
        if after <= 0:
            return [current]
        return replay_plans(job, after, current, self.feed.history(job))

    def AckPlan(self, request, context):
        return self._run(context, self._ack, request)

    def _ack(self, ack: types_pb2.Ack) -> controller_pb2.AckResponse:
        if ack.generation < 1:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "generation must be >= 1")
        spec = self._require_job(ack.job)
        ranks = sum(len(st.ranks) or spec.base_tp for rep in spec.replicas for st in rep.stages)
        if ack.rank >= ranks:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"rank {ack.rank} is not in job {ack.job} ({ranks} ranks)")
        plan = self._plan(ack.job)
        current = plan.generation if plan is not None else 0
        if ack.generation > current:
            raise _Abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"generation {ack.generation} is newer than job {ack.job}'s current plan ({current})",
            )
        stored = types_pb2.Ack()
        stored.CopyFrom(ack)
        stored.acked_at = ack.acked_at or self.clock()
        self.etcd.put(keys.job_ack(ack.job, ack.rank), codec.encode(stored))
        return controller_pb2.AckResponse()

    def ReportStep(self, request, context):
        return self._run(context, self._report, request)

    def _report(self, r: controller_pb2.StepReport) -> controller_pb2.StepReportResponse:
        if not _job_name_ok(r.job):
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "job must be a job name (1-128 characters, no '/')")
        if not r.step_seconds > 0:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "step_seconds must be > 0")
        if not self.steps.known(r.job):
            self._require_job(r.job)
        self.steps.record(r)
        return controller_pb2.StepReportResponse()


def create_grpc_server(
    etcd: Etcd,
    *,
    bind: str = "127.0.0.1:0",
    max_workers: int = 64,
    steps: StepStats | None = None,
    clock: Callable[[], float] = time.time,
    tls: ServerTls | None = None,
    rendezvous: RendezvousLimits | None = RendezvousLimits(),
) -> tuple[grpc.Server, int]:
    """A started-not-yet ``grpc.Server`` serving ``Trainer`` (and the jobs' ``Rendezvous``
    store unless ``rendezvous`` is None), bound to ``bind``; returns it and the bound port
    (``bind`` may use port 0). Call ``server.start()``. ``tls``: none = plaintext, a
    certificate = TLS, plus a client CA = mutual TLS (see tpflex_proto.tls)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="trainer-rpc"),
        options=[("grpc.max_send_message_length", 64 << 20)],
    )
    servicer = TrainerServicer(etcd, steps=steps or StepStats(), clock=clock)
    controller_pb2_grpc.add_TrainerServicer_to_server(servicer, server)
    if rendezvous is not None:  # parked calls hold worker threads: at most half of them
        parked = min(rendezvous.max_parked, max_workers // 2)
        add_rendezvous(server, etcd, dataclasses.replace(rendezvous, max_parked=parked))
    try:
        server, port = bind_grpc(server, bind, tls, service="trainer")
    except RuntimeError as exc:
        raise OSError(f"cannot bind the trainer gRPC server to {bind}: {exc}") from None
    if port == 0:
        raise OSError(f"cannot bind the trainer gRPC server to {bind}")
    return server, port
