"""The controller's trainer-facing gRPC service (``Trainer`` of controller.proto).

Every controller replica serves it, reading and writing etcd directly (no leader needed):
``RegisterJob`` validates and stores a new job spec (or accepts the same one again),
``WatchPlan`` streams a job's plan generations (one shared etcd watch per job, fanned out
to the streams), ``AckPlan`` records a rank's ack (never over a newer one),
``ReportStep`` feeds the in-memory step window (goodput). What each accepts is checked
against its meaning in ``spec_checks``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
from tpflex_proto import (
    codec,
    controller_pb2,
    controller_pb2_grpc,
    keys,
    planstore,
    types_pb2,
)
from tpflex_proto.etcd import Cmp, Etcd, EtcdError, EtcdUnavailable, Op
from tpflex_proto.informer import Informer
from tpflex_proto.tls import ServerTls, TlsFilesError, bind_grpc, server_interceptors

from tpflex_controller import audit
from tpflex_controller.credentials import CALLER, CredentialError, Credentials, JobAuth
from tpflex_controller.liveness import LivenessPolicy, Outcome
from tpflex_controller.liveness_service import LivenessRefused, LivenessService, refused_for
from tpflex_controller.planfeed import PlanFeed
from tpflex_controller.rendezvous import RendezvousLimits, add_rendezvous
from tpflex_controller.spec_checks import (
    DEFAULT_MIN_STEP_SECONDS,
    InputError,
    JobFacts,
    check_ack,
    check_job_name,
    check_model_units,
    check_report,
    check_spec,
    job_facts,
    job_name_ok,
    spec_difference,
    trainer_contradictions,
)
from tpflex_controller.steps import StepStats
from tpflex_controller.store import Store, decode_or_skip

log = logging.getLogger(__name__)


_Abort = LivenessRefused  # one error type and one InputError -> status map (liveness_service)
_abort_for = refused_for


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


class JobFactsCache:
    """What reports and acks are checked against, per job, re-read from etcd when older
    than ``ttl_s`` or when a report names a newer generation than the cached plan's."""

    def __init__(self, store: Store, ttl_s: float = 1.0) -> None:
        self.store, self.ttl_s = store, ttl_s
        self._lock = threading.Lock()
        self._facts: dict[str, tuple[JobFacts, float]] = {}

    def get(self, job: str, generation: int = 0) -> JobFacts | None:
        now = time.monotonic()
        with self._lock:
            hit = self._facts.get(job)
        if hit is not None and now - hit[1] < self.ttl_s and hit[0].generation >= generation:
            return hit[0]
        spec = self.store.job(job)
        if spec is None:
            with self._lock:
                self._facts.pop(job, None)
            return None
        plan = self.store.plan(job)
        facts = job_facts(spec, plan.generation if plan is not None else 0)
        with self._lock:
            if len(self._facts) > 4096:
                self._facts.clear()
            self._facts[job] = (facts, now)
        return facts


def _with_restart(plan: types_pb2.Plan, restart: types_pb2.Restart) -> types_pb2.Plan:
    """The plan as a stream sends it: with the job's current restart epoch."""
    out = types_pb2.Plan()
    out.CopyFrom(plan)
    out.restart.CopyFrom(restart)
    return out


class TrainerServicer(controller_pb2_grpc.TrainerServicer):
    def __init__(self, etcd: Etcd, *, steps: StepStats, clock: Callable[[], float] = time.time,
                 min_step_seconds: float = DEFAULT_MIN_STEP_SECONDS,
                 liveness: LivenessPolicy = LivenessPolicy(),
                 on_liveness: Callable[[str, Outcome], None] = lambda job, out: None,
                 informer: Informer | None = None, credentials: Credentials | None = None):
        self.etcd = etcd
        self.credentials = credentials or Credentials(etcd)
        self.store = Store(etcd)
        self.steps = steps
        self.clock = clock
        self.min_step_seconds = min_step_seconds
        self.facts = JobFactsCache(self.store)
        self.feed = PlanFeed(etcd, informer)  # the process's informer (main) or the feed's own
        self.liveness = LivenessService(etcd, self.store, self.facts, policy=liveness, clock=clock,
                                        on_outcome=on_liveness)

    # ---- helpers ----

    def _run(self, context, fn, *args):
        try:
            return fn(*args)
        except LivenessRefused as exc:
            context.abort(exc.code, exc.message)
        except EtcdUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd unavailable: {exc}")
        except EtcdError as exc:
            context.abort(grpc.StatusCode.INTERNAL, f"etcd error: {exc}")

    def _plan(self, job: str) -> types_pb2.Plan | None:
        try:
            return planstore.read_plan(self.etcd, job)
        except codec.MalformedValue as exc:
            log.warning("skipping malformed etcd value key=%s error=%s", exc.key, exc)
            return None

    def _current(self, job: str) -> types_pb2.Plan | None:
        """The job's plan as the streams send it (with the restart epoch)."""
        plan = self._plan(job)
        return _with_restart(plan, self.liveness.restart(job)) if plan is not None else None

    def _require_facts(self, job: str, generation: int = 0) -> JobFacts:
        try:
            check_job_name(job)
        except InputError as exc:
            raise _abort_for(exc) from None
        facts = self.facts.get(job, generation)
        if facts is None:
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"unknown job {job!r}")
        return facts

    # ---- RPCs ----

    def RegisterJob(self, request, context):
        model = request.model if request.HasField("model") else None
        response = self._run(context, self._register, request.spec, model)
        caller = CALLER.get()
        if caller is not None and caller.operator:  # an admin token: issue the job a credential
            name = request.credential_name or "register"
            try:
                token = self.credentials.issue(request.spec.name, name, f"operator:{caller.operator}")
            except CredentialError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except EtcdError as exc:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd unavailable: {exc}")
            audit.record(who=caller.who, what="trainer.RegisterJob", target=f"job:{request.spec.name}",
                         outcome="ok", request_id=caller.request_id, credential=name)
            response.credential, response.credential_name = token, name
        return response

    def _register(self, spec: types_pb2.JobSpec,
                  model: types_pb2.ModelUnits | None = None) -> controller_pb2.RegisterJobResponse:
        """Create a job, or accept an identical spec again (ranks register concurrently). A
        changed spec of a registered job is refused: changing a live job is an admin's
        explicit operation (REST PUT /v1/jobs/{job}/spec), not a side effect of a trainer
        starting. ``model``: the units the trainer's adapter derived from the model it
        loaded; a spec they contradict is refused (FAILED_PRECONDITION, naming the family)
        before anything is stored."""
        if model is not None:
            self._check_trainer_model(spec, model)
        for _ in range(5):
            guard = self.store.spec_guard_revision()
            existing = self.store.job(spec.name) if job_name_ok(spec.name) else None
            if existing is not None:
                diff = spec_difference(existing, spec)
                if diff:
                    raise _Abort(grpc.StatusCode.ALREADY_EXISTS,
                                 f"job {spec.name} is registered with a different spec (differs in "
                                 f"{', '.join(diff)}); change it with PUT /v1/jobs/{spec.name}/spec "
                                 f"(admin) or delete it with DELETE /v1/jobs/{spec.name}")
                return controller_pb2.RegisterJobResponse(plan=self._current(spec.name))
            try:
                check_spec(spec, self.store.racks(), self.store.job_specs())
            except InputError as exc:
                raise _abort_for(exc) from None
            stored = types_pb2.JobSpec()
            stored.CopyFrom(spec)
            stored.created_at = spec.created_at or self.clock()
            if self.store.write_spec(spec.name, stored, spec_revision=0, guard_revision=guard):
                log.info("job registered job=%s replicas=%d base_tp=%d", spec.name,
                         len(spec.replicas), spec.base_tp)
                return controller_pb2.RegisterJobResponse(plan=self._plan(spec.name))
        raise _Abort(grpc.StatusCode.ABORTED, f"job specs kept changing while job {spec.name} was "
                     "checked; retry")

    def _check_trainer_model(self, spec: types_pb2.JobSpec, model: types_pb2.ModelUnits) -> None:
        try:
            check_model_units(spec.name, model, "the trainer's model")
        except InputError as exc:
            raise _abort_for(exc) from None
        bad = trainer_contradictions(spec, model)
        if bad:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                         f"job {spec.name}: the units of the model the trainer loaded ({model.model_type or 'unknown'}) "
                         f"contradict the job spec: {'; '.join(bad)}")
        recorded = spec.model.config_sha256 if spec.HasField("model") else ""
        if recorded and model.config_sha256 and recorded != model.config_sha256:
            log.warning("trainer model differs from the spec's job=%s spec_config_sha256=%s "
                        "trainer_config_sha256=%s (units agree)", spec.name, recorded[:12],
                        model.config_sha256[:12])

    def WatchPlan(self, request, context):
        try:
            facts = self._require_facts(request.job)
            if request.rank >= facts.ranks:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"rank {request.rank} is not in job {request.job} ({facts.ranks} ranks)")
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
            try:
                restart = self.liveness.restart(request.job)
                backlog = self._backlog(request.job, request.after_generation, request.after_epoch,
                                        restart.epoch)
            except EtcdError as exc:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd unavailable: {exc}")
            last = (request.after_generation, request.after_epoch)
            current = backlog[-1] if backlog else self._plan(request.job)
            for plan in backlog:
                if (plan.generation, restart.epoch) > last:
                    last = (plan.generation, restart.epoch)
                    yield _with_restart(plan, restart)
            while context.is_active() and not sub.closed:
                item = sub.get(timeout=1.0)
                if isinstance(item, types_pb2.Liveness):
                    restart = item.restart if item.restart.epoch > restart.epoch else restart
                elif item is not None and (current is None or item.generation >= current.generation):
                    current = item  # the feed may offer a plan again, or one older than the read
                if current is not None and (current.generation, restart.epoch) > last:
                    last = (current.generation, restart.epoch)
                    yield _with_restart(current, restart)
        finally:
            self.feed.unsubscribe(sub)

    def _backlog(self, job: str, after: int, after_epoch: int = 0, epoch: int = 0) -> list[types_pb2.Plan]:
        """What a stream resuming after generation ``after`` (restart epoch
        ``after_epoch``) missed, oldest first: every committed generation in (after,
        current] from the job's plan history, or the current plan alone when ``after`` is 0
        or older than the history keeps, or when only the epoch moved."""
        current = self._plan(job)
        if current is not None and current.generation == after and epoch > after_epoch:
            return [current]
        if current is None or current.generation <= after:
            return []
        if after <= 0:
            return [current]
        return replay_plans(job, after, current, self.feed.history(job))

    def Heartbeat(self, request_iterator, context):
        return self._run(context, self.liveness.heartbeat, request_iterator, context)

    def ReportRankExit(self, request, context):
        return self._run(context, self.liveness.rank_exit, request)

    def AckPlan(self, request, context):
        return self._run(context, self._ack, request)

    def _ack(self, ack: types_pb2.Ack) -> controller_pb2.AckResponse:
        facts = self._require_facts(ack.job, ack.generation)
        key = keys.job_ack(ack.job, ack.rank) if ack.rank < facts.ranks else ""
        for _ in range(8):
            kv = self.etcd.get(key) if key else None
            stored = decode_or_skip(types_pb2.Ack, kv) if kv is not None else None
            try:
                check_ack(ack, facts, stored.generation if stored is not None else 0)
            except InputError as exc:
                raise _abort_for(exc) from None
            if stored is not None and stored.generation == ack.generation:
                return controller_pb2.AckResponse()  # already recorded
            record = types_pb2.Ack(job=ack.job, rank=ack.rank, generation=ack.generation,
                                   acked_at=self.clock(), reshard_seconds=ack.reshard_seconds)
            guard = (Cmp.mod_revision(key, "==", kv.mod_revision) if kv is not None
                     else Cmp.create_revision(key, "==", 0))
            if self.etcd.txn([guard], [Op.put(key, codec.encode(record))]).succeeded:
                return controller_pb2.AckResponse()
        raise _Abort(grpc.StatusCode.ABORTED, f"ack of rank {ack.rank} raced with others; retry")

    def ReportStep(self, request, context):
        return self._run(context, self._report, request)

    def _report(self, r: controller_pb2.StepReport) -> controller_pb2.StepReportResponse:
        facts = self._require_facts(r.job, r.generation)
        try:
            check_report(r, facts, self.min_step_seconds)
        except InputError as exc:
            raise _abort_for(exc) from None
        self.steps.record(r, full_tp=facts.full_tp)
        return controller_pb2.StepReportResponse()


def create_grpc_server(
    etcd: Etcd,
    *,
    bind: str = "127.0.0.1:0",
    max_workers: int = 64,
    steps: StepStats | None = None,
    clock: Callable[[], float] = time.time,
    tls: ServerTls | None = None,
    min_step_seconds: float = DEFAULT_MIN_STEP_SECONDS,
    rendezvous: RendezvousLimits | None = RendezvousLimits(),
    liveness: LivenessPolicy = LivenessPolicy(),
    on_liveness: Callable[[str, Outcome], None] = lambda job, out: None,
    informer: Informer | None = None,
    job_auth: JobAuth | None = None,
) -> tuple[grpc.Server, int]:
    """A started-not-yet ``grpc.Server`` serving ``Trainer`` (and the jobs' ``Rendezvous``
    store unless ``rendezvous`` is None), bound to ``bind``; returns it and the bound port
    (``bind`` may use port 0). Call ``server.start()``. ``tls``: none = plaintext, a
    certificate = TLS, plus a client CA = mutual TLS, gRPC's own (see tpflex_proto.tls).
    ``informer``: the process's shared informer, which the plan feed then takes its plans
    from (tpflex_controller.planfeed); without one the feed runs one per watched job."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="trainer-rpc"),
        options=[("grpc.max_send_message_length", 64 << 20)],
        interceptors=[*server_interceptors(tls, service="trainer"), *([job_auth] if job_auth else [])],
    )
    servicer = TrainerServicer(etcd, steps=steps or StepStats(), clock=clock,
                               min_step_seconds=min_step_seconds, liveness=liveness,
                               on_liveness=on_liveness, informer=informer,
                               credentials=job_auth.credentials if job_auth else None)
    servicer.liveness.start()
    controller_pb2_grpc.add_TrainerServicer_to_server(servicer, server)
    if rendezvous is not None:  # parked calls hold worker threads: at most half of them
        parked = min(rendezvous.max_parked, max_workers // 2)
        add_rendezvous(server, etcd, dataclasses.replace(rendezvous, max_parked=parked))
    try:
        return bind_grpc(server, bind, tls, service="trainer")
    except TlsFilesError as exc:
        raise TlsFilesError(f"trainer gRPC TLS (trainer.tls_cert_file, tls_key_file, client_ca_file): {exc}") from None
    except OSError as exc:
        raise OSError(f"cannot bind the trainer gRPC server: {exc}") from None
