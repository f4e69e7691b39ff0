"""The trainer's side of the control plane: plan stream, heartbeats, acks, step reports.

``ControlClient`` streams a job's plans from any of the configured controller endpoints
on a background thread, reconnecting with backoff and resuming after the last generation
(and restart epoch) seen; each newer round is passed to ``on_round`` (the hooks abort
their process groups when it says a member of theirs is gone: ``hooks.abort``). A second thread keeps one ``Heartbeat`` stream
open on the same channel and sends a beat every ``beat_interval_s`` (when
``beat_interval_s`` > 0). Acks and step reports are queued and sent by a sender thread with per-call
timeouts and bounded retries, so nothing here blocks a training step: if the controller
is unreachable, training goes on with the last plan.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from tpflex_proto import controller_pb2, controller_pb2_grpc, types_pb2
from tpflex_proto.backoff import Backoff
from tpflex_proto.tls import ClientCertificateFiles

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ControlConfig:
    endpoints: tuple[str, ...]  # controller gRPC host:port, tried in order
    job: str
    rank: int
    call_timeout_s: float = 2.0
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0
    queue_size: int = 1024
    beat_interval_s: float = 0.0  # 0 = no heartbeats
    resubscribe_s: float = 5.0  # a rank waiting this long for a newer round re-opens its plan stream
    incarnation: int = 0  # the process's restart count (TPFLEX_RESTART_COUNT)
    beat_file: str = ""  # touched at every beat (tpflex-run watches it)
    # TLS to the controller's Trainer service: trust tls_ca_file; present tls_cert_file /
    # tls_key_file when the controller requires client certificates (trainer.client_ca_file);
    # tls_server_name overrides the name checked in the controller's certificate.
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_server_name: str | None = None
    # the job's credential (tpflex-run's TPFLEX_JOB_CREDENTIAL_FILE), sent with every call as
    # ``authorization: Bearer``; the controller refuses calls on other jobs
    credential: str | None = None


class _Credential(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                  grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <credential>`` to every call of a channel (TLS or not:
    gRPC's call credentials need TLS, and a loopback test controller may run without)."""

    def __init__(self, token: str) -> None:
        self._pair = ("authorization", f"Bearer {token}")

    def _details(self, details):
        metadata = [*(details.metadata or ()), self._pair]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            getattr(details, "wait_for_ready", None),
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


def read_credential(path: str) -> str:
    """A job credential from its file (one line; surrounding whitespace ignored)."""
    with open(path, encoding="utf-8") as f:
        token = f.read().strip()
    if not token or any(c.isspace() for c in token):
        raise ValueError(f"{path}: not a job credential (one token, no whitespace)")
    return token


_CREDENTIALS: dict[tuple, ClientCertificateFiles] = {}
_CREDENTIALS_LOCK = threading.Lock()


def _tls(config: ControlConfig) -> tuple[grpc.ChannelCredentials, list[tuple[str, str]]]:
    """The channel's TLS credentials (tpflex_proto.tls: read again when a file changed, so a
    renewed certificate is used by the next channel) and the server-name override."""
    files = (config.tls_ca_file, config.tls_cert_file, config.tls_key_file)
    with _CREDENTIALS_LOCK:
        creds = _CREDENTIALS.get(files)
        if creds is None:
            creds = _CREDENTIALS[files] = ClientCertificateFiles(*files)
    options = [("grpc.ssl_target_name_override", config.tls_server_name)] if config.tls_server_name else []
    return creds.get(), options


def open_channel(config: ControlConfig, endpoint: str) -> grpc.Channel:
    """A channel to one controller endpoint with ``config``'s TLS settings (the plan stream
    and the rendezvous store share this)."""
    if config.tls_ca_file:
        channel = grpc.secure_channel(endpoint, *_tls(config))
    else:
        channel = grpc.insecure_channel(endpoint)
    if config.credential:
        channel = grpc.intercept_channel(channel, _Credential(config.credential))
    return channel


class PlanRejected(ValueError):
    """A plan that does not match this job/rank or is older than the one applied."""


def check_plan(plan: types_pb2.Plan, job: str, applied_generation: int) -> None:
    """Refuse a plan for another job or one not newer than what is applied."""
    if plan.job != job:
        raise PlanRejected(f"plan is for job {plan.job!r}, this is job {job!r}")
    if plan.generation <= applied_generation:
        raise PlanRejected(
            f"plan generation {plan.generation} is not newer than applied {applied_generation}"
        )


def plan_round(plan: types_pb2.Plan | None) -> tuple[int, int]:
    """(generation, restart epoch): what the ranks apply, in order."""
    return (plan.generation, plan.restart.epoch) if plan is not None else (0, 0)


BeatState = Callable[[], tuple[int, int, int, float]]  # generation, epoch, step, hung_s


class RegistrationRefused(ValueError):
    """The controller refused this trainer's registration for good: the model it loaded
    contradicts the job's spec (the message names the unit family)."""


class ControlClient:
    def __init__(self, config: ControlConfig, *, on_round: Callable[[types_pb2.Plan], None] = lambda p: None,
                 beat_state: BeatState = lambda: (0, 0, 0, 0.0)) -> None:
        if not config.endpoints:
            raise ValueError("at least one controller endpoint is required")
        self.config = config
        self._lock = threading.Condition()
        self._latest: types_pb2.Plan | None = None
        self._seen = (0, 0)
        self.on_round, self.beat_state = on_round, beat_state
        self.beats_sent = 0
        self._stop = threading.Event()
        self._outbox: queue.Queue = queue.Queue(maxsize=config.queue_size)
        self._channels: dict[str, grpc.Channel] = {}
        self._stream_call = None
        self.connected = threading.Event()
        self.dropped_reports = 0
        self._threads = [
            threading.Thread(target=self._watch_loop, name="tpflex-plan-stream", daemon=True),
            threading.Thread(target=self._send_loop, name="tpflex-control-sender", daemon=True),
        ]
        self._file_beats_end = threading.Event()
        if config.beat_interval_s > 0:
            self._threads.append(threading.Thread(target=self._beat_loop, name="tpflex-heartbeat", daemon=True))
            if config.beat_file:
                self._threads.append(threading.Thread(target=self._beat_file_loop, name="tpflex-beat-file",
                                                      daemon=True))

    # ---- lifecycle ----

    def start(self) -> ControlClient:
        for t in self._threads:
            t.start()
        return self

    def close(self) -> None:
        self.end_beats()  # beats stop on purpose: tpflex-run must not take it for a hang
        self._stop.set()
        for t in self._threads:  # the heartbeat stream's goodbye reaches the controller
            if t.name == "tpflex-heartbeat" and t.is_alive() and t is not threading.current_thread():
                t.join(2.0)
        call = self._stream_call
        if call is not None:
            call.cancel()
        self._outbox.put(None)
        for t in self._threads:
            t.join(timeout=5)
        for ch in self._channels.values():
            ch.close()

    def _channel(self, endpoint: str) -> grpc.Channel:
        ch = self._channels.get(endpoint)
        if ch is None:
            ch = open_channel(self.config, endpoint)
            self._channels[endpoint] = ch
        return ch

    def _stub(self, endpoint: str) -> controller_pb2_grpc.TrainerStub:
        return controller_pb2_grpc.TrainerStub(self._channel(endpoint))

    # ---- unary calls with timeouts, trying each endpoint once ----

    def _call(self, method: str, request):
        last: grpc.RpcError | None = None
        for endpoint in self.config.endpoints:
            try:
                return getattr(self._stub(endpoint), method)(
                    request, timeout=self.config.call_timeout_s
                )
            except grpc.RpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                last = exc
        assert last is not None
        raise last

    def register_job(self, spec: types_pb2.JobSpec,
                     model: types_pb2.ModelUnits | None = None) -> types_pb2.Plan | None:
        """Register the job (idempotent); returns the current plan if there is one.
        ``model``: the units this rank's adapter derived; :class:`RegistrationRefused` when
        the controller finds they contradict the spec (FAILED_PRECONDITION)."""
        request = controller_pb2.RegisterJobRequest(spec=spec, model=model)
        try:
            resp = self._call("RegisterJob", request)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise RegistrationRefused(exc.details()) from None
            if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                raise RegistrationRefused(f"the controller refused this trainer's job credential "
                                          f"({exc.code().name}): {exc.details()}") from None
            raise
        if resp.HasField("plan") and resp.plan.generation:
            self._offer(resp.plan)
            return resp.plan
        return None

    # ---- plans ----

    def latest_plan(self) -> types_pb2.Plan | None:
        with self._lock:
            return self._latest

    def wait_for_generation(self, generation: int, timeout: float) -> types_pb2.Plan | None:
        """Block until a plan of at least ``generation`` has arrived and return it; None
        when none has by the timeout (an older plan is not an answer)."""
        with self._lock:
            arrived = self._lock.wait_for(
                lambda: self._latest is not None and self._latest.generation >= generation,
                timeout,
            )
            return self._latest if arrived else None

    def wait_for_newer(self, generation: int, timeout: float) -> types_pb2.Plan | None:
        return self.wait_for_generation(generation + 1, timeout)

    def wait_for_round(self, applied: tuple[int, int], timeout: float) -> types_pb2.Plan | None:
        """Block until a plan newer than ``applied`` (generation, restart epoch) arrived.
        Every ``resubscribe_s`` without one, the plan stream is opened again on the next
        endpoint (resuming after the last round seen): a replica whose feed stalled (its
        etcd watch lost with an etcd member) must not keep a waiting rank from the round
        every other replica already serves."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                left = deadline - time.monotonic()
                arrived = self._lock.wait_for(lambda: plan_round(self._latest) > applied,
                                              max(0.0, min(left, self.config.resubscribe_s)))
                if arrived:
                    return self._latest
            if time.monotonic() >= deadline:
                return None
            log.info("plan stream resubscribing job=%s rank=%d waiting_for_newer_than=%s", self.config.job,
                     self.config.rank, applied)
            self.resubscribe()

    def resubscribe(self) -> None:
        """End the current plan stream; the stream thread opens it again on the next endpoint."""
        call = self._stream_call
        if call is not None:
            call.cancel()

    def _offer(self, plan: types_pb2.Plan) -> None:
        with self._lock:
            if plan.job != self.config.job:
                log.warning("plan refused job=%s plan_job=%s", self.config.job, plan.job)
                return
            if plan_round(plan) <= self._seen:
                return
            restarted = plan.restart.epoch > self._seen[1]
            self._seen = plan_round(plan)
            self._latest = plan
            self._lock.notify_all()
        if restarted:
            log.warning("restart epoch job=%s rank=%d generation=%d epoch=%d reason=%s", self.config.job,
                        self.config.rank, plan.generation, plan.restart.epoch, plan.restart.reason)
        self.on_round(plan)

    def _watch_loop(self) -> None:
        backoff = self._backoff()
        attempt = 0
        while not self._stop.is_set():
            endpoint = self.config.endpoints[attempt % len(self.config.endpoints)]
            attempt += 1
            req = controller_pb2.WatchPlanRequest(
                job=self.config.job, after_generation=self._seen[0], rank=self.config.rank,
                after_epoch=self._seen[1],
            )
            try:
                self._stream_call = self._stub(endpoint).WatchPlan(req)
                for plan in self._stream_call:
                    if not self.connected.is_set():
                        log.info("plan stream connected endpoint=%s rank=%d", endpoint, self.config.rank)
                    self.connected.set()
                    backoff.reset()
                    self._offer(plan)
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    return
                pause = backoff.next()
                log.info(
                    "plan stream interrupted endpoint=%s code=%s retry_in=%.2fs",
                    endpoint, exc.code().name, pause,
                )
            else:
                pause = backoff.next()
            self.connected.clear()
            self._stop.wait(pause)

    def _backoff(self) -> Backoff:
        """The jittered pause of a reconnect loop (the ranks of a job must not all retry
        at the same instant after a controller failover)."""
        return Backoff(self.config.backoff_initial_s, self.config.backoff_max_s)

    # ---- heartbeats: one stream on the plan stream's channel ----

    def _beats(self):
        while not self._stop.is_set():
            generation, epoch, step, hung_s = self.beat_state()
            yield controller_pb2.Beat(job=self.config.job, rank=self.config.rank,
                                      incarnation=self.config.incarnation, generation=generation,
                                      epoch=epoch, step=step, hung_s=hung_s)
            self.beats_sent += 1
            self._stop.wait(self.config.beat_interval_s)
        # close(): the rank leaves on purpose; a stream that ends without this broke
        yield controller_pb2.Beat(job=self.config.job, rank=self.config.rank,
                                  incarnation=self.config.incarnation, goodbye=True)

    def _beat_file_loop(self) -> None:
        """tpflex-run's beat file: touched by its own thread, so that it says only whether
        the process runs (a frozen one stops touching it), not whether a controller is
        reachable (the stream's reconnects must not look like a hang)."""
        while not self._file_beats_end.is_set():
            try:
                with open(self.config.beat_file, "a"):
                    os.utime(self.config.beat_file)
            except OSError as exc:
                log.warning("beat file not touched path=%s error=%s", self.config.beat_file, exc)
            self._file_beats_end.wait(self.config.beat_interval_s)

    def end_beats(self) -> None:
        """Stop touching the beat file and remove it: this process ends on purpose (its
        last seconds, flushing reports, must not look like a hang to tpflex-run)."""
        self._file_beats_end.set()
        for t in self._threads:  # its last touch is done before the file goes
            if t.name == "tpflex-beat-file" and t.is_alive() and t is not threading.current_thread():
                t.join(5.0)
        if self.config.beat_file:
            try:
                os.unlink(self.config.beat_file)
            except OSError:
                pass

    def _beat_loop(self) -> None:
        backoff, attempt = self._backoff(), 0
        while not self._stop.is_set():
            endpoint = self.config.endpoints[attempt % len(self.config.endpoints)]
            attempt += 1
            try:
                self._stub(endpoint).Heartbeat(self._beats())
                return  # closed by close(): the iterator ended, a clean goodbye
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    return
                level = logging.INFO if exc.code() == grpc.StatusCode.UNAVAILABLE else logging.WARNING
                pause = backoff.next()
                log.log(level, "heartbeat stream interrupted endpoint=%s code=%s detail=%s retry_in=%.2fs",
                        endpoint, exc.code().name, exc.details(), pause)
            self._stop.wait(pause)

    # ---- acks and step reports (queued, never blocking the caller) ----

    def ack(self, generation: int, reshard_seconds: float = 0.0) -> None:
        ack = types_pb2.Ack(
            job=self.config.job,
            rank=self.config.rank,
            generation=generation,
            acked_at=time.time(),
            reshard_seconds=reshard_seconds,
        )
        self._enqueue(("AckPlan", ack, 20))

    def report_step(self, report: controller_pb2.StepReport) -> None:
        self._enqueue(("ReportStep", report, 1))

    def _enqueue(self, item) -> None:
        try:
            self._outbox.put_nowait(item)
        except queue.Full:
            self.dropped_reports += 1

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued has been sent or given up on."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._outbox.unfinished_tasks == 0:
                return True
            self._stop.wait(0.01)
        return False

    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            try:
                if item is None:
                    return
                method, msg, tries = item
                self._send(method, msg, tries)
            finally:
                self._outbox.task_done()

    def _send(self, method: str, msg, tries: int) -> None:
        backoff = self._backoff()
        for attempt in range(tries):
            if self._stop.is_set():
                return
            try:
                self._call(method, msg)
                return
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    if attempt + 1 < tries:
                        self._stop.wait(backoff.next())
                    continue
                log.warning("control call refused method=%s code=%s detail=%s",
                            method, exc.code().name, exc.details())
                return
        log.info("control call given up method=%s tries=%d", method, tries)


PlanListener = Callable[[types_pb2.Plan], None]


def endpoints_from(value: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(e.strip() for e in value.split(",") if e.strip())
    return tuple(value)
