"""Rank liveness on a real trainer gRPC server and a real etcd: the Heartbeat stream,
tpflex-run's ReportRankExit, the missed-beat monitor, the restart epoch on the plan
stream, escalation to a drain, and the bounds on what a trainer can send."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from concurrent import futures

import grpc
import pytest
from tpflex_controller import synthetic
from tpflex_controller.liveness import LivenessPolicy
from tpflex_controller.steps import StepStats
from tpflex_controller.trainer_service import TrainerServicer
from tpflex_proto import codec, controller_pb2, controller_pb2_grpc, keys, types_pb2
from tpflex_proto.etcd import Etcd

from tests.controller.controller_harness import small_cluster
from tests.reliability.proxy import CuttableProxy
from tests.support.wait import wait_until

POLICY = LivenessPolicy(beat_timeout_s=0.6, window_s=60.0, max_soft_failures=3, beat_burst=5, beats_per_s=20.0)
GPUS = [("rack0-n00", 0), ("rack0-n00", 1), ("rack0-n01", 0), ("rack0-n01", 1)]


@contextlib.contextmanager
def _serve(etcd, servicer_etcd):
    """A trainer service on ``servicer_etcd`` (``etcd`` itself, or a client through a proxy)
    with job j (4 ranks) registered and planned."""
    outcomes: list[tuple[str, str]] = []
    servicer = TrainerServicer(servicer_etcd, steps=StepStats(), liveness=POLICY,
                               on_liveness=lambda j, o: outcomes.append((j, o.kind)))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    controller_pb2_grpc.add_TrainerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.liveness.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    racks = small_cluster(etcd)
    spec = synthetic.job("j", [racks[0].name], 4)
    spec.replicas[0].stages[0].ranks.extend(types_pb2.GpuRef(node=n, index=i) for n, i in GPUS)
    stub = controller_pb2_grpc.TrainerStub(channel)
    stub.RegisterJob(controller_pb2.RegisterJobRequest(spec=spec), timeout=5)
    plan = types_pb2.Plan(job="j", generation=1, policy="ntp-pw")
    plan.replicas.add(index=0, tp_degree=4).stages.add(gpus=[types_pb2.GpuRef(node=n, index=i) for n, i in GPUS])
    etcd.put(keys.job_plan("j"), codec.encode(plan))
    try:
        yield stub, outcomes, servicer.liveness.tracker
    finally:
        servicer.liveness.stop()
        channel.close()
        server.stop(grace=1).wait()


@pytest.fixture
def live(etcd):
    with _serve(etcd, etcd) as served:
        yield served


def _record(etcd) -> types_pb2.Liveness | None:
    kv = etcd.get(keys.liveness("j"))
    return codec.decode(types_pb2.Liveness, kv.value) if kv is not None else None


def _epoch(etcd) -> int:
    rec = _record(etcd)
    return rec.restart.epoch if rec is not None else 0


class Beats:
    """A client's Heartbeat stream: ``beat()`` sends one; ``end()`` says goodbye."""

    def __init__(self, stub, **fields) -> None:
        self.fields = dict(job="j", generation=1, **fields)
        self._items: list = []
        self._cv = threading.Condition()
        self.future = stub.Heartbeat.future(self._gen(), timeout=30)

    def _gen(self):
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._items)
                item = self._items.pop(0)
            if item is None:
                return
            yield controller_pb2.Beat(**{**self.fields, **item})

    def beat(self, **extra) -> None:
        with self._cv:
            self._items.append(extra)
            self._cv.notify()

    def end(self) -> None:
        with self._cv:
            self._items.append({"goodbye": True})
            self._items.append(None)
            self._cv.notify()


def test_a_rank_that_stops_beating_is_a_soft_failure_told_on_the_plan_stream(etcd, live):
    stub, outcomes, tracker = live
    stream = stub.WatchPlan(controller_pb2.WatchPlanRequest(job="j", after_generation=0, rank=0), timeout=30)
    first = next(stream)
    assert (first.generation, first.restart.epoch) == (1, 0)
    beats = Beats(stub, rank=2, incarnation=0)
    for _ in range(3):
        beats.beat()
    wait_until(lambda: _epoch(etcd) == 1, 30, "the silent rank's soft failure")
    got = next(stream)  # the same plan again, with the new restart epoch
    assert (got.generation, got.restart.epoch, got.restart.rank) == (1, 1, 2)
    assert "rank 2 on rack0-n01:0 heartbeat_lost" in got.restart.reason
    assert [(f.rank, f.node, f.gpu, f.reason) for f in _record(etcd).recent] == [(2, "rack0-n01", 0, "heartbeat_lost")]
    assert outcomes == [("j", "soft")]
    beats.end()
    # a stream resuming after (1, 0) gets the new epoch; after (1, 1) nothing is pending
    again = stub.WatchPlan(controller_pb2.WatchPlanRequest(job="j", after_generation=1, after_epoch=0), timeout=5)
    assert next(again).restart.epoch == 1
    again.cancel()
    stream.cancel()


def test_a_clean_goodbye_is_not_a_failure_and_a_broken_stream_is(etcd, live):
    stub, outcomes, tracker = live
    bye = Beats(stub, rank=0)
    bye.beat()
    bye.end()
    assert bye.future.result(timeout=5).beats == 1
    broken = Beats(stub, rank=1)
    broken.beat()
    wait_until(lambda: tracker.watched() == 1, 5, "the beat reaching the server")
    broken.future.cancel()  # the process vanished: the server sees the call cancelled
    wait_until(lambda: _epoch(etcd) == 1, 30, "the broken stream's soft failure")
    assert [f.rank for f in _record(etcd).recent] == [1]
    assert outcomes == [("j", "soft")]


def test_rank_exits_count_once_and_repeated_ones_drain_the_gpu(etcd, live):
    stub, outcomes, tracker = live
    report = lambda inc, reason="signal:SIGKILL": stub.ReportRankExit(  # noqa: E731
        controller_pb2.RankExit(job="j", node="rack0-n00", gpu=1, incarnation=inc, reason=reason), timeout=5)
    report(0)
    report(0)  # the same death again (a retried report): counted once
    assert _epoch(etcd) == 1 and etcd.get(keys.gpu_override("rack0-n00", 1)) is None
    report(1, "exit:3")
    assert _epoch(etcd) == 2 and etcd.get(keys.gpu_override("rack0-n00", 1)) is None
    report(2, "exit:\n3")
    override = codec.decode(types_pb2.GpuOverride, etcd.get(keys.gpu_override("rack0-n00", 1)).value)
    assert override.drained
    assert "3 soft failures of the rank on rack0-n00:1" in override.reason
    assert "signal:SIGKILL, exit:3, exit:?3" in override.reason
    assert _record(etcd).restart.reason.startswith("hard failure")
    assert outcomes == [("j", "soft"), ("j", "soft"), ("j", "hard")]


def test_a_hang_report_bumps_the_epoch_once(etcd, live):
    stub, outcomes, tracker = live
    a, b = Beats(stub, rank=0), Beats(stub, rank=1)
    a.beat(hung_s=12.0)
    wait_until(lambda: _epoch(etcd) == 1, 5, "the hang's epoch")
    b.beat(hung_s=12.5)  # the same hang seen by another rank, still at epoch 0
    b.beat(epoch=1)
    a.end()
    b.end()
    assert a.future.result(timeout=5).beats == 1 and b.future.result(timeout=5).beats == 2
    assert _epoch(etcd) == 1 and outcomes == [("j", "hang")]
    assert "hang: rank 0 stuck 12.0s" in _record(etcd).restart.reason


@pytest.mark.parametrize("beat, code, text", [
    (dict(job="nope", rank=0), grpc.StatusCode.NOT_FOUND, "unknown job"),
    (dict(job="a/b", rank=0), grpc.StatusCode.INVALID_ARGUMENT, "job name"),
    (dict(rank=4), grpc.StatusCode.INVALID_ARGUMENT, "rank 4"),
    (dict(rank=0, generation=9), grpc.StatusCode.FAILED_PRECONDITION, "generation 9"),
    (dict(rank=0, epoch=3), grpc.StatusCode.FAILED_PRECONDITION, "epoch 3"),
    (dict(rank=0, hung_s=math.nan), grpc.StatusCode.INVALID_ARGUMENT, "hung_s"),
    (dict(rank=0, hung_s=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "hung_s"),
])
def test_bad_beats_are_refused_and_change_nothing(etcd, live, beat, code, text):
    stub, outcomes, tracker = live
    fields = {"job": "j", "generation": 1, **beat}
    with pytest.raises(grpc.RpcError) as err:
        stub.Heartbeat(iter([controller_pb2.Beat(**fields)]), timeout=5)
    assert err.value.code() == code and text in err.value.details()
    assert _record(etcd) is None and outcomes == []


def test_a_beat_flood_and_a_stream_changing_rank_are_refused(etcd, live):
    stub, _, _ = live
    with pytest.raises(grpc.RpcError) as err:
        stub.Heartbeat(iter([controller_pb2.Beat(job="j", rank=0, generation=1)] * 50), timeout=5)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "faster than" in err.value.details()
    two = [controller_pb2.Beat(job="j", rank=0, generation=1), controller_pb2.Beat(job="j", rank=1, generation=1)]
    with pytest.raises(grpc.RpcError) as err:
        stub.Heartbeat(iter(two), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "one rank" in err.value.details()
    # a refused stream is not watched: no soft failure follows it
    assert _record(etcd) is None


@pytest.mark.parametrize("exit_, code, text", [
    (dict(job="nope", node="rack0-n00", gpu=0), grpc.StatusCode.NOT_FOUND, "unknown job"),
    (dict(job="j", node="rack1-n00", gpu=0), grpc.StatusCode.INVALID_ARGUMENT, "not a rank of job j"),
    (dict(job="j", node="rack0-n00", gpu=7), grpc.StatusCode.INVALID_ARGUMENT, "not a rank of job j"),
    (dict(job="", node="rack0-n00", gpu=0), grpc.StatusCode.INVALID_ARGUMENT, "job name"),
])
def test_bad_rank_exits_are_refused(etcd, live, exit_, code, text):
    stub, _, _ = live
    with pytest.raises(grpc.RpcError) as err:
        stub.ReportRankExit(controller_pb2.RankExit(**exit_, reason="x"), timeout=5)
    assert err.value.code() == code and text in err.value.details()
    assert _record(etcd) is None


def test_a_gpu_outside_the_plan_re_forms_the_groups_but_counts_nothing(etcd, live):
    stub, outcomes, tracker = live
    plan = types_pb2.Plan(job="j", generation=2, policy="ntp-pw")
    plan.replicas.add(index=0, tp_degree=2).stages.add(gpus=[types_pb2.GpuRef(node=n, index=i) for n, i in GPUS[:2]])
    etcd.put(keys.job_plan("j"), codec.encode(plan))
    for inc in range(4):
        stub.ReportRankExit(controller_pb2.RankExit(job="j", node="rack0-n01", gpu=1, incarnation=inc,
                                                    reason="exit:1"), timeout=5)
    assert _epoch(etcd) == 4 and etcd.get(keys.gpu_override("rack0-n01", 1)) is None
    assert outcomes == [("j", "outside_plan")] * 4


def test_a_rank_on_a_failed_gpu_the_plan_dropped_raises_no_epoch(etcd, live):
    stub, outcomes, _ = live
    plan = types_pb2.Plan(job="j", generation=2, policy="ntp-pw", cause="gpu_failed")
    plan.replicas.add(index=0, tp_degree=2).stages.add(gpus=[types_pb2.GpuRef(node=n, index=i) for n, i in GPUS[:2]])
    etcd.put(keys.job_plan("j"), codec.encode(plan))
    health = types_pb2.NodeHealth(node="rack0-n01", gpus=[types_pb2.GpuHealth(index=1, state=types_pb2.GPU_FAILED)])
    etcd.put(keys.health("rack0-n01"), codec.encode(health))
    stub.ReportRankExit(controller_pb2.RankExit(job="j", node="rack0-n01", gpu=1, incarnation=0,
                                                reason="exit:1"), timeout=5)
    assert _record(etcd) is None and outcomes == []
    # the same GPU healthy again (repaired, not yet re-planned): a hand-over may be under way
    health.gpus[0].state = types_pb2.GPU_HEALTHY
    etcd.put(keys.health("rack0-n01"), codec.encode(health))
    stub.ReportRankExit(controller_pb2.RankExit(job="j", node="rack0-n01", gpu=1, incarnation=1,
                                                reason="exit:1"), timeout=5)
    assert _epoch(etcd) == 1 and outcomes == [("j", "outside_plan")]


def test_a_rank_declared_failed_that_beats_on_is_revived_and_its_death_counts(etcd, live):
    """The 10-minute soak's checkpoint restart: rank 0 was declared failed while the process
    lived on (there: its stream broke on a replica's etcd error; here: a beat gap; epoch 1); it joined the epoch-1 round and beat at
    epoch 1; its SIGKILL later (the same incarnation) must raise the epoch again, or the
    round it was in waits for it forever."""
    stub, outcomes, tracker = live
    beats = Beats(stub, rank=0, incarnation=1)
    beats.beat()
    wait_until(lambda: _epoch(etcd) == 1, 30, "the declaration of the beat gap")
    assert [(f.rank, f.incarnation) for f in _record(etcd).recent] == [(0, 1)]
    beats.beat(epoch=1)  # it applied the round its declaration raised: it was alive
    wait_until(lambda: not _record(etcd).recent, 10, "the declaration withdrawn")
    beats.end()  # (a goodbye: no second beat gap to time)
    assert beats.future.result(timeout=5).beats == 2 and tracker.watched() == 0
    assert _epoch(etcd) == 1
    stub.ReportRankExit(controller_pb2.RankExit(job="j", node="rack0-n00", gpu=0, incarnation=1,
                                                reason="signal:SIGKILL"), timeout=5)
    assert _epoch(etcd) == 2 and "rank 0 on rack0-n00:0 signal:SIGKILL" in _record(etcd).restart.reason
    assert outcomes == [("j", "soft"), ("j", "revived"), ("j", "soft")]


def test_a_beat_at_an_older_epoch_withdraws_nothing(etcd, live):
    stub, outcomes, tracker = live
    stub.ReportRankExit(controller_pb2.RankExit(job="j", node="rack0-n00", gpu=1, incarnation=0,
                                                reason="signal:SIGKILL"), timeout=5)
    late = Beats(stub, rank=1, incarnation=0)
    late.beat(epoch=0)  # sent before the death: proves nothing
    late.end()
    assert late.future.result(timeout=5).beats == 1
    assert [(f.rank, f.incarnation) for f in _record(etcd).recent] == [(1, 0)]
    assert outcomes == [("j", "soft")]


def test_an_etcd_error_under_a_beat_is_no_silence_of_the_rank(etcd, etcd_server):
    """A replica that cannot read etcd (a member just killed) ends the beat stream with
    UNAVAILABLE and stops watching the rank, which beats on to another replica: declaring
    it silent (what the soak saw) restarts the whole job's groups for nothing."""
    proxy = CuttableProxy(etcd_server.endpoints[0])
    via = Etcd([proxy.endpoint], timeout=1.0)
    try:
        with _serve(etcd, via) as (stub, outcomes, tracker):
            beats = Beats(stub, rank=2, incarnation=0)
            beats.beat()
            wait_until(lambda: tracker.watched() == 1, 5, "the beat reaching the server")
            proxy.cut()
            time.sleep(1.1)  # the replica's cached epoch (1 s) expires: the next beat reads etcd
            beats.beat()
            with pytest.raises(grpc.RpcError) as err:
                beats.future.result(timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "etcd" in err.value.details()
            proxy.heal()
            assert tracker.watched() == 0
            time.sleep(POLICY.beat_timeout_s * 3)  # the monitor runs every 0.15 s: a declaration would be made
            assert _record(etcd) is None and outcomes == []
    finally:
        via.close()
        proxy.close()


def test_a_stream_ending_without_a_goodbye_beat_broke_and_nothing_follows_a_goodbye(etcd, live):
    """Only the goodbye beat makes an ended stream a clean goodbye: a half-close without
    it is a broken stream (a cancelled call can end the server's iterator the same way),
    and a beat after the goodbye is refused."""
    stub, outcomes, tracker = live
    ended = Beats(stub, rank=2)
    ended.beat()
    with ended._cv:  # the stream ends with no goodbye beat
        ended._items.append(None)
        ended._cv.notify()
    assert ended.future.result(timeout=5).beats == 1
    wait_until(lambda: _epoch(etcd) == 1, 30, "the ended stream's soft failure")
    assert [f.rank for f in _record(etcd).recent] == [2] and outcomes == [("j", "soft")]
    after = [controller_pb2.Beat(job="j", rank=3, generation=1, epoch=1, goodbye=True),
             controller_pb2.Beat(job="j", rank=3, generation=1, epoch=1)]
    with pytest.raises(grpc.RpcError) as err:
        stub.Heartbeat(iter(after), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "after the stream's goodbye" in err.value.details()
    assert tracker.watched() == 0
