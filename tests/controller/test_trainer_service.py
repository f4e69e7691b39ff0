"""The Trainer gRPC service on a real server (port 0, real channel) and a real etcd."""

from __future__ import annotations

import threading

import grpc
import pytest
from prometheus_client import CollectorRegistry
from tpflex_controller import synthetic
from tpflex_controller.steps import GoodputCollector, StepStats
from tpflex_controller.trainer_service import create_grpc_server
from tpflex_proto import codec, controller_pb2, controller_pb2_grpc, keys, types_pb2

from tests.controller.controller_harness import small_cluster


@pytest.fixture
def trainer(etcd):
    steps = StepStats()
    server, port = create_grpc_server(etcd, bind="127.0.0.1:0", max_workers=8, steps=steps)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield controller_pb2_grpc.TrainerStub(channel), steps
    finally:
        channel.close()
        server.stop(grace=1).wait()


def _plan(etcd, job: str, generation: int) -> types_pb2.Plan:
    plan = types_pb2.Plan(job=job, generation=generation, policy="ntp-pw", cause="test")
    etcd.put(keys.job_plan(job), codec.encode(plan))
    return plan


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_register_job_validates_and_is_idempotent(etcd, trainer):
    stub, _ = trainer
    racks = small_cluster(etcd)
    spec = synthetic.job("train", [r.name for r in racks], 4)
    stub.RegisterJob(controller_pb2.RegisterJobRequest(spec=spec), timeout=5)
    stored = etcd.get(keys.job_spec("train"))
    again = stub.RegisterJob(controller_pb2.RegisterJobRequest(spec=spec), timeout=5)
    assert etcd.get(keys.job_spec("train")).mod_revision == stored.mod_revision  # no rewrite
    assert again.plan.generation == 0  # nothing planned yet (no controller running)

    bad = [
        (synthetic.job("x", ["nope"], 4), "unknown rack 'nope'"),
        (synthetic.job("x", [racks[0].name], 5), "base TP degree is 5"),
        (synthetic.job("x", [racks[0].name], 4, policy="fastest"), "unknown policy"),
        (synthetic.job("x", [racks[0].name], 4, min_tp=9), "min_tp"),
        (synthetic.job("a/b", [racks[0].name], 4), "job name"),
    ]
    for spec_bad, why in bad:
        code, details = _code(lambda s=spec_bad: stub.RegisterJob(controller_pb2.RegisterJobRequest(spec=s), timeout=5))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert why in details
    wrong_gpu = synthetic.job("y", [racks[0].name], 4)
    wrong_gpu.replicas[0].stages[0].ranks.extend(
        [types_pb2.GpuRef(node="rack0-n00", index=i) for i in range(3)] + [types_pb2.GpuRef(node="rack1-n00", index=0)]
    )
    code, details = _code(lambda: stub.RegisterJob(controller_pb2.RegisterJobRequest(spec=wrong_gpu), timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not in rack rack0" in details
    jobs, _ = etcd.get_prefix(keys.JOBS)
    assert [kv.key for kv in jobs] == [keys.job_spec("train")]  # rejected specs stored nothing


def test_watch_plan_streams_current_then_every_new_generation(etcd, trainer):
    stub, _ = trainer
    racks = small_cluster(etcd)
    stub.RegisterJob(controller_pb2.RegisterJobRequest(spec=synthetic.job("j", [r.name for r in racks], 4)), timeout=5)
    _plan(etcd, "j", 1)
    stream = stub.WatchPlan(controller_pb2.WatchPlanRequest(job="j", after_generation=0), timeout=30)
    got = [next(stream).generation]
    for g in (2, 3):
        _plan(etcd, "j", g)
        got.append(next(stream).generation)
    assert got == [1, 2, 3]
    stream.cancel()

    # resuming after generation 3: nothing at once, then generation 4
    resumed = stub.WatchPlan(controller_pb2.WatchPlanRequest(job="j", after_generation=3), timeout=30)
    first: list[int] = []
    reader = threading.Thread(target=lambda: first.append(next(resumed).generation))
    reader.start()
    reader.join(0.5)
    assert not first  # generation 3 is not re-sent
    _plan(etcd, "j", 4)
    reader.join(10)
    assert first == [4]
    resumed.cancel()

    code, details = _code(lambda: next(stub.WatchPlan(controller_pb2.WatchPlanRequest(job="ghost"), timeout=5)))
    assert code == grpc.StatusCode.NOT_FOUND and "ghost" in details


def test_ack_plan_records_and_rejects_bad_acks(etcd, trainer):
    stub, _ = trainer
    racks = small_cluster(etcd)
    stub.RegisterJob(controller_pb2.RegisterJobRequest(spec=synthetic.job("j", [r.name for r in racks], 4)), timeout=5)
    _plan(etcd, "j", 2)
    stub.AckPlan(types_pb2.Ack(job="j", rank=5, generation=2, reshard_seconds=0.3), timeout=5)
    ack = codec.decode(types_pb2.Ack, etcd.get(keys.job_ack("j", 5)).value)
    assert (ack.rank, ack.generation, ack.reshard_seconds) == (5, 2, 0.3) and ack.acked_at > 0

    cases = [
        (types_pb2.Ack(job="nope", rank=0, generation=1), grpc.StatusCode.NOT_FOUND),
        (types_pb2.Ack(job="j", rank=0, generation=3), grpc.StatusCode.FAILED_PRECONDITION),
        (types_pb2.Ack(job="j", rank=0, generation=0), grpc.StatusCode.INVALID_ARGUMENT),
        (types_pb2.Ack(job="j", rank=8, generation=1), grpc.StatusCode.INVALID_ARGUMENT),
        (types_pb2.Ack(job="", rank=0, generation=1), grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for ack_bad, want in cases:
        code, details = _code(lambda a=ack_bad: stub.AckPlan(a, timeout=5))
        assert code == want and details
    acks, _ = etcd.get_prefix(keys.job_acks("j"))
    assert [kv.key for kv in acks] == [keys.job_ack("j", 5)]


def test_report_step_feeds_the_goodput_window(etcd, trainer):
    stub, steps = trainer
    racks = small_cluster(etcd)
    stub.RegisterJob(controller_pb2.RegisterJobRequest(spec=synthetic.job("j", [r.name for r in racks], 4)), timeout=5)
    _plan(etcd, "j", 1)
    for step in range(4):
        for replica in (0, 1):
            for rank in range(2):  # two ranks of a replica report the same step: counted once
                stub.ReportStep(
                    controller_pb2.StepReport(job="j", rank=rank, replica=replica, step=step, generation=1,
                                              step_seconds=0.5 if replica == 0 else 1.0, samples=8),
                    timeout=5,
                )
    # received within milliseconds: each replica's rate is bounded by its reported step time
    assert steps.achieved_samples_per_second("j") == pytest.approx(8 / 0.5 + 8 / 1.0)
    registry = CollectorRegistry()
    registry.register(GoodputCollector(steps))
    assert registry.get_sample_value(
        "tpflex_job_achieved_samples_per_second", {"training_job": "j"}
    ) == pytest.approx(24.0)
    code, _ = _code(lambda: stub.ReportStep(controller_pb2.StepReport(job="j", step_seconds=0), timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _ = _code(lambda: stub.ReportStep(controller_pb2.StepReport(job="zz", step_seconds=1), timeout=5))
    assert code == grpc.StatusCode.NOT_FOUND
    assert steps.achieved_samples_per_second("zz") is None


def test_plan_feed_shares_one_informer_and_drops_it_with_the_last_stream(etcd):
    from tpflex_controller.planfeed import PlanFeed

    feed = PlanFeed(etcd)  # no shared informer: one of the job's own keys
    a, b = feed.subscribe("j"), feed.subscribe("j")
    assert list(feed._own) == ["j"]
    informer = feed._own["j"][0]
    _plan(etcd, "j", 1)
    assert a.get(timeout=5).generation == 1 and b.get(timeout=5).generation == 1
    feed.unsubscribe(a)
    assert list(feed._own) == ["j"]
    b.close()
    feed.unsubscribe(b)
    assert feed._own == {} and feed.watched_jobs() == [] and b.get(timeout=0.1) is None
    assert not informer._thread.is_alive()


def test_plan_feed_on_the_shared_informer_offers_what_follows_each_subscription(etcd):
    """The controller's feed takes plans from the process's informer: a subscription made
    before the informer synced and one made after both get every later generation; the
    plan current at a subscription is not offered as news; an unwatched job's plans are
    not assembled."""
    from tpflex_controller.planfeed import PlanFeed
    from tpflex_proto.informer import Informer

    informer = Informer(etcd)
    feed = PlanFeed(etcd, informer)
    early = feed.subscribe("j")  # before the informer has listed anything
    informer.start()
    try:
        assert informer.synced.wait(10)
        _plan(etcd, "j", 1)
        assert early.get(timeout=5).generation == 1
        late = feed.subscribe("j")
        other = feed.subscribe("k")
        _plan(etcd, "k", 7)
        assert other.get(timeout=5).generation == 7
        assert late.get(timeout=0.2) is None  # generation 1 was current when it subscribed
        _plan(etcd, "j", 2)
        assert early.get(timeout=5).generation == 2 and late.get(timeout=5).generation == 2
        for sub in (early, late, other):
            feed.unsubscribe(sub)
        assert feed.watched_jobs() == []
        _plan(etcd, "j", 3)
        assert informer.wait_revision(etcd.get(keys.job_plan("j")).mod_revision, 5)
        assert early.get(timeout=0.2) is None
    finally:
        informer.stop()
