"""The hooks against the real controller Trainer gRPC service (port 0 / a fixed port for
restarts, real channels) on a real etcd: the plan stream survives the controller going
away, acks and step reports never block the caller, and plans that do not fit the job
are refused with a logged reason while training goes on in the current layout."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from tpflex_controller.trainer_service import create_grpc_server
from tpflex_proto import codec, controller_pb2, keys, types_pb2
from tpflex_trainer.demo.data import global_batch
from tpflex_trainer.demo.launcher import demo_job_spec
from tpflex_trainer.demo.model import DEMO_ADAM, DEMO_MODEL, DEMO_SEED
from tpflex_trainer.hooks.config import HooksConfig, write_spec
from tpflex_trainer.hooks.control import ControlClient, ControlConfig
from tpflex_trainer.hooks.trainer import TpflexHooks

JOB = "hooks-job"


def _plan(generation: int, job: str = JOB, gpu=("n0", 0), local: int = 4) -> types_pb2.Plan:
    p = types_pb2.Plan(job=job, generation=generation, policy="ntp-pw", cause="test")
    rep = p.replicas.add(index=0, tp_degree=1, local_batch=local)
    rep.stages.add(rack="r0", tp_degree=1, spec_stage=0,
                   gpus=[types_pb2.GpuRef(node=gpu[0], index=gpu[1])])
    return p


def _commit(etcd, plan: types_pb2.Plan, job: str = JOB) -> None:
    etcd.put(keys.job_plan(job), codec.encode(plan))


def _serve(etcd, bind: str = "127.0.0.1:0"):
    server, port = create_grpc_server(etcd, bind=bind, max_workers=8)
    server.start()
    return server, port


def _until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.02)


@pytest.fixture
def job_spec(etcd):
    spec = demo_job_spec(JOB, [("r0", "n0", 1)], 4, DEMO_MODEL.unit_counts())
    etcd.put(keys.job_spec(JOB), codec.encode(spec))
    return spec


def test_client_keeps_its_plan_and_reconnects_when_the_controller_goes_away(etcd, job_spec):
    _commit(etcd, _plan(1))
    server, port = _serve(etcd)
    config = ControlConfig(endpoints=(f"127.0.0.1:{port}",), job=JOB, rank=0,
                           call_timeout_s=0.5, backoff_max_s=0.2)
    client = ControlClient(config).start()
    try:
        assert client.wait_for_generation(1, 10).generation == 1
        server.stop(grace=0).wait()
        _until(lambda: not client.connected.is_set(), 10, "the client sees the stream end")
        assert client.latest_plan().generation == 1  # training goes on with the last plan
        assert client.wait_for_generation(2, 0.3) is None  # an older plan is no answer

        t0 = time.monotonic()
        client.ack(1, 0.25)
        client.report_step(controller_pb2.StepReport(job=JOB, rank=0, step=1, generation=1,
                                                     step_seconds=0.1, samples=4, tokens=128))
        assert time.monotonic() - t0 < config.call_timeout_s  # queued, not sent inline
        assert not client.flush(0.3)  # nothing can be sent while the controller is away
        assert etcd.get(keys.job_ack(JOB, 0)) is None

        _commit(etcd, _plan(2))  # the controller re-plans while this trainer is cut off
        server, _ = _serve(etcd, bind=f"127.0.0.1:{port}")
        plan = client.wait_for_generation(2, 15)  # reconnected with backoff, resumed after g1
        assert plan is not None and plan.generation == 2
        _until(lambda: etcd.get(keys.job_ack(JOB, 0)) is not None, 15, "the queued ack arrives")
        kv = etcd.get(keys.job_ack(JOB, 0))
        ack = codec.decode(types_pb2.Ack, kv.value, kv.key)
        assert (ack.rank, ack.generation, ack.reshard_seconds) == (0, 1, 0.25)
    finally:
        client.close()
        server.stop(grace=0).wait()


def test_calls_give_up_within_their_timeouts_when_no_controller_answers(tmp_path):
    dead = f"127.0.0.1:{_unused_port()}"
    client = ControlClient(ControlConfig(endpoints=(dead,), job=JOB, rank=0, call_timeout_s=0.2,
                                         backoff_initial_s=0.01, backoff_max_s=0.05)).start()
    try:
        t0 = time.monotonic()
        for step in range(50):
            client.report_step(controller_pb2.StepReport(job=JOB, rank=0, step=step,
                                                         step_seconds=0.1, samples=1))
        assert time.monotonic() - t0 < 0.2 * 50  # none of them waited for a call
        assert client.flush(30)  # each report is tried once and dropped: the queue drains
        assert client.latest_plan() is None and not client.connected.is_set()
    finally:
        client.close()


def test_a_rank_waiting_for_a_round_leaves_a_stalled_plan_stream(etcd, job_spec):
    # a replica whose plan feed stalled (here: one that holds every WatchPlan open and never
    # sends) must not keep a waiting rank from the round the other replica serves
    import threading
    from concurrent import futures

    import grpc
    from tpflex_proto import controller_pb2_grpc

    class Stalled(controller_pb2_grpc.TrainerServicer):
        def WatchPlan(self, request, context):
            done = threading.Event()
            context.add_callback(done.set)
            done.wait(60)
            return iter(())

    stalled = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    controller_pb2_grpc.add_TrainerServicer_to_server(Stalled(), stalled)
    stalled_port = stalled.add_insecure_port("127.0.0.1:0")
    stalled.start()
    server, port = _serve(etcd)
    _commit(etcd, _plan(1))
    client = ControlClient(ControlConfig(endpoints=(f"127.0.0.1:{stalled_port}", f"127.0.0.1:{port}"), job=JOB,
                                         rank=0, backoff_initial_s=0.01, backoff_max_s=0.05,
                                         resubscribe_s=0.5)).start()
    try:
        plan = client.wait_for_round((0, 0), 30)
        assert plan is not None and plan.generation == 1
    finally:
        client.close()
        stalled.stop(0).wait()
        server.stop(0).wait()


def test_the_beat_file_says_the_process_runs_even_with_no_controller(tmp_path):
    # tpflex-run kills a rank whose beat file goes stale; a controller outage (the heartbeat
    # stream reconnecting) is no hang, and a process that is closing must not look like one
    beat = tmp_path / "rank-0.beat"
    dead = f"127.0.0.1:{_unused_port()}"
    client = ControlClient(ControlConfig(endpoints=(dead,), job=JOB, rank=0, call_timeout_s=0.2,
                                         backoff_initial_s=0.5, backoff_max_s=2.0, beat_interval_s=0.05,
                                         beat_file=str(beat))).start()
    try:
        from tests.support.wait import wait_until

        first = wait_until(lambda: beat.exists() and beat.stat().st_mtime_ns, 30, "the first beat")
        wait_until(lambda: beat.stat().st_mtime_ns > first, 30, "a later beat without a controller")
        assert client.beats_sent == 0  # no stream ever carried one
        client.end_beats()  # returns after the beat thread's last touch
        assert not beat.exists()
    finally:
        client.close()


def _unused_port() -> int:
    from tests.support.ports import free_port

    return free_port()


@pytest.fixture
def one_rank_hooks(etcd, job_spec, tmp_path):
    """TpflexHooks for a 1-GPU job (one gloo process: this one) wired to a real Trainer
    service and a real TCPStore."""
    server, port = _serve(etcd)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30),
                          wait_for_workers=False)
    write_spec(job_spec, tmp_path / "job.json")
    config = HooksConfig(controller=(f"127.0.0.1:{port}",), job=JOB, node="n0", gpu=0,
                         store=f"127.0.0.1:{store.port}", spec_file=str(tmp_path / "job.json"),
                         backend="gloo", plan_wait_s=10.0, collective_timeout_s=30.0)
    hooks = TpflexHooks(config, DEMO_MODEL, adam=DEMO_ADAM, seed=DEMO_SEED)
    try:
        yield hooks
    finally:
        hooks.close()
        server.stop(grace=0).wait()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_hooks_refuse_plans_that_do_not_fit_and_keep_training(etcd, one_rank_hooks, caplog):
    hooks = one_rank_hooks
    caplog.set_level(logging.INFO)

    def step() -> float:
        return hooks.train_step(lambda s, n: global_batch(DEMO_MODEL, s, n))

    _commit(etcd, _plan(1))
    assert hooks.start().generation == 1
    layout = hooks.runtime.layout
    step()

    _commit(etcd, _plan(2, job="another-job"))  # stored under this job's key by mistake
    _until(lambda: "plan_job=another-job" in caplog.text, 10, "the client refuses it")
    _commit(etcd, _plan(3, gpu=("n0", 5)))  # a GPU this job does not have
    assert hooks.client.wait_for_generation(3, 10).generation == 3
    for _ in range(2):
        step()
    refusals = [r.getMessage() for r in caplog.records if "plan refused job=hooks-job rank=0" in r.getMessage()]
    assert len(refusals) == 1, refusals  # refused once, remembered
    assert "generation=3" in refusals[0] and "('n0', 5) outside its spec stage" in refusals[0]
    assert "keeping_generation=1" in refusals[0]
    assert hooks.generation == 1 and hooks.runtime.layout is layout and hooks.step == 3

    _commit(etcd, _plan(4, local=2))  # a plan that fits is applied at the next boundary
    assert hooks.client.wait_for_generation(4, 10).generation == 4
    step()
    assert hooks.generation == 4 and hooks.runtime.layout.global_batch == 2
    assert [a.generation for a in hooks.history] == [1, 4]
    assert hooks.step == 4  # no step lost or repeated
    hooks.client.flush(10)
    kv = etcd.get(keys.job_ack(JOB, 0))
    assert codec.decode(types_pb2.Ack, kv.value, kv.key).generation == 4


def test_plan_stream_reconnects_wait_a_jittered_exponential_pause(caplog):
    """The reconnect loop's pauses come from the shared jittered backoff: each within
    [half, all] of the doubling step, capped, and not the bare step every time (ranks
    that lost the same controller must not retry in lockstep)."""
    import re

    from tests.support.wait import wait_until

    caplog.set_level(logging.INFO, logger="tpflex_trainer.hooks.control")
    dead = f"127.0.0.1:{_unused_port()}"
    client = ControlClient(ControlConfig(endpoints=(dead,), job=JOB, rank=0, call_timeout_s=0.2,
                                         backoff_initial_s=0.02, backoff_max_s=0.08)).start()

    def pauses() -> list[float]:
        return [float(m.group(1)) for r in caplog.records
                if (m := re.search(r"plan stream interrupted .* retry_in=([0-9.]+)s", r.getMessage()))]

    try:
        wait_until(lambda: len(pauses()) >= 6, 20, "six plan stream reconnect attempts")
    finally:
        client.close()
    got = pauses()[:6]
    steps = [0.02, 0.04, 0.08, 0.08, 0.08, 0.08]
    assert all(step / 2 - 0.005 <= p <= step + 0.005 for p, step in zip(got, steps, strict=True)), got
    assert any(abs(p - step) > 0.006 for p, step in zip(got, steps, strict=True)), got
