"""Rank liveness at the trainer service's edge: the ``Heartbeat`` stream, tpflex-run's
``ReportRankExit``, the missed-beat monitor, and the job's liveness record in etcd
(``keys.liveness(job)``, written by compare-and-swap from any replica). The decisions
are ``liveness``'s; a hard failure drains the GPU through its override (as the REST
drain does), and the leader re-plans without it.

Each replica watches the ranks that beat to it. A rank whose stream moves to another
replica (its replica became unreachable) is not declared silent there: the replica that
lost it is the unreachable one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc
from tpflex_proto import codec, controller_pb2, keys, types_pb2
from tpflex_proto.etcd import Cmp, Etcd, EtcdError, Op

from tpflex_controller.liveness import (
    BeatTracker,
    LivenessPolicy,
    Outcome,
    TokenBucket,
    apply_failure,
    apply_hang,
    apply_revival,
    check_beat,
    clean_reason,
    declared,
    plan_gpus,
    rank_gpus,
)
from tpflex_controller.spec_checks import InputError, check_job_name
from tpflex_controller.store import Store

log = logging.getLogger(__name__)


def _epoch_of(record: types_pb2.Liveness | None) -> int:
    return record.restart.epoch if record is not None else 0


class LivenessRefused(Exception):
    """A trainer-plane call refused with a gRPC status (the Trainer service's too)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


# what each kind of InputError (spec_checks) answers on the trainer plane: the one map
INPUT_STATUS = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "conflict": grpc.StatusCode.ALREADY_EXISTS,
    "stale": grpc.StatusCode.FAILED_PRECONDITION,
    "future": grpc.StatusCode.FAILED_PRECONDITION,
    "unknown": grpc.StatusCode.NOT_FOUND,
}


def refused_for(exc: InputError) -> LivenessRefused:
    return LivenessRefused(INPUT_STATUS.get(exc.kind, grpc.StatusCode.INVALID_ARGUMENT), exc.message)


class LivenessService:
    def __init__(self, etcd: Etcd, store: Store, facts, *, policy: LivenessPolicy = LivenessPolicy(),
                 clock: Callable[[], float] = time.time, on_outcome: Callable[[str, Outcome], None] = lambda j, o: None):
        self.etcd, self.store, self.facts, self.policy = etcd, store, facts, policy
        self.clock, self.on_outcome = clock, on_outcome
        self.tracker = BeatTracker(policy.beat_timeout_s)
        self._lock = threading.Lock()
        self._records: dict[str, tuple[types_pb2.Liveness | None, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._monitor, name="liveness-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    # ---------------------------------------------------------------- the record

    def record(self, job: str) -> tuple[types_pb2.Liveness | None, int]:
        """The job's stored record (None when it has none) and its mod revision."""
        kv = self.etcd.get(keys.liveness(job))
        if kv is None:
            return None, 0
        try:
            return codec.decode(types_pb2.Liveness, kv.value, kv.key), kv.mod_revision
        except codec.MalformedValue as exc:
            log.warning("skipping malformed etcd value key=%s error=%s", kv.key, exc)
            return None, kv.mod_revision

    def restart(self, job: str) -> types_pb2.Restart:
        record, _ = self.record(job)
        return record.restart if record is not None else types_pb2.Restart()

    def epoch(self, job: str, at_least: int = 0) -> int:
        """The job's restart epoch, cached for a second (re-read when a beat names a newer one)."""
        record = self.cached_record(job, at_least)
        return record.restart.epoch if record is not None else 0

    def cached_record(self, job: str, at_least_epoch: int = 0) -> types_pb2.Liveness | None:
        """The job's record, at most a second old (re-read when a newer epoch is asked for)."""
        now = time.monotonic()
        with self._lock:
            hit = self._records.get(job)
        if hit is not None and now - hit[1] < 1.0 and _epoch_of(hit[0]) >= at_least_epoch:
            return hit[0]
        record, _ = self.record(job)
        self._remember(job, record, now)
        return record

    def _remember(self, job: str, record: types_pb2.Liveness | None, at: float) -> None:
        with self._lock:
            if len(self._records) > 4096:
                self._records.clear()
            self._records[job] = (record, at)

    def _update(self, job: str, decide: Callable[[types_pb2.Liveness | None], Outcome]) -> Outcome:
        for _ in range(8):
            record, rev = self.record(job)
            out = decide(record)
            if out.record is None:
                return out
            key = keys.liveness(job)
            guard = Cmp.mod_revision(key, "==", rev) if rev else Cmp.create_revision(key, "==", 0)
            if self.etcd.txn([guard], [Op.put(key, codec.encode(out.record))]).succeeded:
                self._remember(job, out.record, time.monotonic())
                if out.kind != "revived":  # (no epoch change: the caller logs it)
                    log.warning("rank restart job=%s kind=%s epoch=%d reason=%s", job, out.kind,
                                out.record.restart.epoch, out.record.restart.reason)
                if out.drain:
                    self._drain(out.record.recent[-1], out.drain)
                self.on_outcome(job, out)
                return out
        raise LivenessRefused(grpc.StatusCode.ABORTED, f"liveness record of job {job} kept changing; retry")

    def _drain(self, failure: types_pb2.SoftFailure, reason: str) -> None:
        at = self.clock()

        def drained(old: types_pb2.GpuOverride | None) -> types_pb2.GpuOverride:
            if old is not None and old.drained:
                return old
            return types_pb2.GpuOverride(gpu=types_pb2.GpuRef(node=failure.node, index=failure.gpu),
                                         drained=True, reason=reason, power_cap_w=old.power_cap_w if old else 0.0,
                                         at=at)

        self.store.update(keys.gpu_override(failure.node, failure.gpu), types_pb2.GpuOverride, drained)
        log.error("gpu drained after repeated soft failures node=%s gpu=%d reason=%s", failure.node,
                  failure.gpu, reason)

    # ---------------------------------------------------------------- soft failures

    def soft_failure(self, job: str, rank: int, incarnation: int, reason: str) -> Outcome:
        spec = self.store.job(job)
        if spec is None:
            raise LivenessRefused(grpc.StatusCode.NOT_FOUND, f"unknown job {job!r}")
        gpus = rank_gpus(spec)
        if rank < len(gpus):
            node, gpu = gpus[rank]
            in_plan = (node, gpu) in plan_gpus(self.store.plan(job))
            gpu_failed = not in_plan and self._gpu_failed(node, gpu)
        else:  # a spec whose stages name no GPUs: the rank's GPU is the planner's choice
            node, gpu, in_plan, gpu_failed = "", 0, True, False
        failure = types_pb2.SoftFailure(rank=rank, node=node, gpu=gpu, incarnation=incarnation,
                                        reason=clean_reason(reason), at=self.clock())
        return self._update(job, lambda rec: apply_failure(rec, job, failure, self.policy, failure.at,
                                                           in_plan=in_plan, gpu_failed=gpu_failed))

    def _gpu_failed(self, node: str, gpu: int) -> bool:
        """The node's agent reports the GPU failed (``health/<node>``)."""
        health = self.store.node_health(node)
        return health is not None and any(
            g.index == gpu and g.state == types_pb2.GPU_FAILED for g in health.gpus)

    def rank_exit(self, req: controller_pb2.RankExit) -> controller_pb2.RankExitResponse:
        """tpflex-run: the process of a rank on (node, gpu) ended abnormally."""
        self._job(req.job)
        spec = self.store.job(req.job)
        if spec is None:
            raise LivenessRefused(grpc.StatusCode.NOT_FOUND, f"unknown job {req.job!r}")
        gpus = rank_gpus(spec)
        if (req.node, req.gpu) not in gpus:
            raise LivenessRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"GPU {req.node[:64]}:{req.gpu} is not a rank of job {req.job}")
        rank = gpus.index((req.node, req.gpu))
        self.tracker.forget(req.job, rank)
        self.soft_failure(req.job, rank, req.incarnation, req.reason)
        return controller_pb2.RankExitResponse()

    def _job(self, job: str):
        try:
            check_job_name(job)
        except InputError as exc:
            raise refused_for(exc) from None

    def _monitor(self) -> None:
        period = min(1.0, self.policy.beat_timeout_s / 4)
        while not self._stop.wait(period):
            for s in self.tracker.expired(time.monotonic()):
                try:
                    self.soft_failure(s.job, s.rank, s.incarnation, s.reason)
                except (LivenessRefused, EtcdError) as exc:
                    log.warning("silent rank not recorded job=%s rank=%d error=%s", s.job, s.rank, exc)

    # ---------------------------------------------------------------- beats

    def heartbeat(self, beats, context) -> controller_pb2.HeartbeatSummary:
        """One rank's beats, until it ends the stream with a goodbye beat (``Beat.goodbye``:
        not watched any more) or the stream ends without one (broken: silent unless it
        beats again in time)."""
        bucket = TokenBucket(self.policy.beat_burst, self.policy.beats_per_s)
        who: tuple[str, int, int] | None = None
        n, goodbye = 0, False
        try:
            for beat in beats:
                if goodbye:
                    raise LivenessRefused(grpc.StatusCode.INVALID_ARGUMENT, "a beat after the stream's goodbye")
                if not bucket.take(time.monotonic()):
                    raise LivenessRefused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                          f"beats faster than {self.policy.beats_per_s:g}/s "
                                          f"(burst {self.policy.beat_burst})")
                if who is not None and (beat.job, beat.rank, beat.incarnation) != who:
                    raise LivenessRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                          "a heartbeat stream beats for one rank (job, rank, incarnation)")
                self._check(beat)
                who = (beat.job, beat.rank, beat.incarnation)
                if beat.goodbye:
                    goodbye = True  # not a beat: the stream ends on purpose
                    continue
                self.tracker.beat(beat.job, beat.rank, beat.incarnation, time.monotonic())
                self._revive(beat)
                if beat.hung_s > 0:
                    self._update(beat.job, lambda rec, b=beat: apply_hang(rec, b.job, b.rank, b.epoch,
                                                                          b.hung_s, self.clock()))
                n += 1
        except LivenessRefused:
            if who is not None:
                self.tracker.forget(who[0], who[1])
            raise
        except EtcdError as exc:
            # this replica cannot serve the stream (etcd unreachable from here); the rank
            # moves to another replica: that is no silence of the rank's
            if who is not None:
                self.tracker.forget(who[0], who[1])
            raise LivenessRefused(grpc.StatusCode.UNAVAILABLE, f"etcd unavailable: {exc}") from None
        except Exception as exc:  # the connection broke under the iterator
            log.info("heartbeat stream broken job=%s error=%s", who[0] if who else "?", type(exc).__name__)
        if who is not None:
            if goodbye:
                self.tracker.forget(who[0], who[1])  # the rank said goodbye
            else:  # broken (a cancelled call may end the iterator like a half-close)
                self.tracker.closed(who[0], who[1], who[2], time.monotonic())
        return controller_pb2.HeartbeatSummary(beats=n)

    def _revive(self, beat: controller_pb2.Beat) -> None:
        """A beat of a process the record lists as failed, at the current epoch: it lived on
        after the declaration, which is withdrawn (``liveness.apply_revival``)."""
        if not declared(self.cached_record(beat.job), beat.rank, beat.incarnation):
            return
        out = self._update(beat.job, lambda rec: apply_revival(rec, beat.rank, beat.incarnation, beat.epoch))
        if out.kind == "revived":
            log.warning("rank declared failed is alive; failure withdrawn job=%s rank=%d incarnation=%d epoch=%d",
                        beat.job, beat.rank, beat.incarnation, beat.epoch)

    def _check(self, beat: controller_pb2.Beat) -> None:
        self._job(beat.job)
        facts = self.facts.get(beat.job, beat.generation)
        if facts is None:
            raise LivenessRefused(grpc.StatusCode.NOT_FOUND, f"unknown job {beat.job!r}")
        try:
            check_beat(beat, facts, self.epoch(beat.job, beat.epoch))
        except InputError as exc:
            raise refused_for(exc) from None
