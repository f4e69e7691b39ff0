"""WatchPlan replays the generations a reconnecting trainer missed: a real etcd, a real
in-process controller committing plans (and their history), the real Trainer gRPC service
on port 0 with a real channel."""

from __future__ import annotations

import logging
from contextlib import contextmanager

import grpc
from tpflex_controller.trainer_service import create_grpc_server, replay_plans
from tpflex_proto import controller_pb2, controller_pb2_grpc, types_pb2

from tests.controller.controller_harness import controller_on_job, fail_gpu

JOB = "job1"


@contextmanager
def _trainer(etcd):
    server, port = create_grpc_server(etcd, bind="127.0.0.1:0", max_workers=8)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield controller_pb2_grpc.TrainerStub(channel)
    finally:
        channel.close()
        server.stop(grace=1).wait()


def _commit_missed(etcd, watcher) -> list[int]:
    """Three more generations, each from a real GPU failure the controller plans around."""
    fail_gpu(etcd, "rack1-n00", 2, {1}, seq=1)
    watcher.wait_generation(2)
    fail_gpu(etcd, "rack1-n00", 2, {0, 1}, seq=2)
    watcher.wait_generation(3)
    fail_gpu(etcd, "rack0-n00", 2, {0}, seq=3)
    return [watcher.wait_generation(4).generation]


def test_reconnect_replays_every_missed_generation_then_follows(etcd_server, etcd):
    with controller_on_job(etcd_server, etcd) as (_, watcher, _ctl), _trainer(etcd) as stub:
        first = stub.WatchPlan(controller_pb2.WatchPlanRequest(job=JOB), timeout=30)
        assert next(first).generation == watcher.wait_generation(1).generation == 1
        first.cancel()  # the trainer goes away

        _commit_missed(etcd, watcher)  # generations 2..4 while no stream is open

        resumed = stub.WatchPlan(controller_pb2.WatchPlanRequest(job=JOB, after_generation=1), timeout=30)
        got = [next(resumed) for _ in range(3)]
        assert [p.generation for p in got] == [2, 3, 4]
        assert [p.cause for p in got] == ["gpu_failed"] * 3
        assert [[r.tp_degree for r in p.replicas] for p in got] == [[4, 3], [4, 2], [3, 2]]

        fail_gpu(etcd, "rack0-n00", 2, set(), seq=4)  # a new one after the replay
        assert next(resumed).generation == 5 == watcher.wait_generation(5).generation
        resumed.cancel()

        fresh = stub.WatchPlan(controller_pb2.WatchPlanRequest(job=JOB, after_generation=0), timeout=30)
        assert next(fresh).generation == 5  # a new trainer gets the current plan only
        fresh.cancel()


def test_reconnect_older_than_history_gets_current_plan_and_a_log_line(etcd_server, etcd, caplog):
    caplog.set_level(logging.WARNING, logger="tpflex_controller.trainer_service")
    with controller_on_job(etcd_server, etcd, history_size=2) as (_, watcher, _ctl), _trainer(etcd) as stub:
        watcher.wait_generation(1)
        _commit_missed(etcd, watcher)  # history keeps generations 3 and 4 only
        resumed = stub.WatchPlan(controller_pb2.WatchPlanRequest(job=JOB, after_generation=1), timeout=30)
        assert next(resumed).generation == 4
        resumed.cancel()
    lines = [r.getMessage() for r in caplog.records if "older than history" in r.getMessage()]
    assert lines and "after_generation=1" in lines[0] and "oldest_kept=3" in lines[0]


def _plan(g: int) -> types_pb2.Plan:
    return types_pb2.Plan(job=JOB, generation=g)


def test_replay_plans_orders_and_bounds():
    history = [_plan(g) for g in (5, 3, 4, 6)]
    assert [p.generation for p in replay_plans(JOB, 3, _plan(6), history)] == [4, 5, 6]
    assert [p.generation for p in replay_plans(JOB, 5, _plan(6), history)] == [6]
    assert [p.generation for p in replay_plans(JOB, 1, _plan(6), history)] == [6]  # too old
    assert [p.generation for p in replay_plans(JOB, 2, _plan(6), history)] == [3, 4, 5, 6]
