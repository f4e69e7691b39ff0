"""Hypothesis-generated gRPC messages to a real agent process and to the controller's
Trainer service: no crash, every rejection carries a status code and a message, and a
rejected call touches no device and no etcd state."""

from __future__ import annotations

import string

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tpflex_controller.trainer_service import create_grpc_server
from tpflex_proto import agent_pb2, agent_pb2_grpc, controller_pb2, controller_pb2_grpc, types_pb2
from tpflex_proto.etcd import Etcd

from tests.agent.support import AgentProcess
from tests.controller.controller_harness import put_job, small_cluster
from tests.reliability.fleet import record

pytestmark = pytest.mark.slow  # a real agent process

REJECTIONS = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.ABORTED,
    grpc.StatusCode.PERMISSION_DENIED,
}
_u32 = st.integers(0, 2**32 - 1)
_u64 = st.integers(0, 2**64 - 1)
_f64 = st.floats(allow_nan=True, allow_infinity=True)
_text = st.text(string.printable + "é/\x00", max_size=24)


def _counted(tally: dict, key: str, call):
    """Call; a rejection must be a known status with a message. Returns True if rejected."""
    try:
        call()
    except grpc.RpcError as exc:
        assert exc.code() in REJECTIONS, (key, exc.code(), exc.details())
        assert exc.details(), (key, exc.code())
        tally[f"{key}_rejected"] = tally.get(f"{key}_rejected", 0) + 1
        return True
    tally[f"{key}_accepted"] = tally.get(f"{key}_accepted", 0) + 1
    return False


# ---- agent ----

NODE = "fuzz-n0"


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    from tests.support.etcd_server import EtcdCluster

    cluster = EtcdCluster(1, tmp_path_factory.mktemp("rel-grpc") / "etcd").start()
    proc = AgentProcess(["--node", NODE, "--rack", "r1", "--backend", "sim", "--sim-gpus", "4",
                         "--etcd", ",".join(cluster.endpoints), "--listen", "127.0.0.1:0", "--insecure",
                         "--metrics-listen", "127.0.0.1:0", "--health-poll-s", "0.1"])
    channel = grpc.insecure_channel(proc.grpc_address)
    try:
        yield agent_pb2_grpc.AgentStub(channel), proc
    finally:
        channel.close()
        proc.kill()
        cluster.stop()


def _device_state(stub) -> list[tuple]:
    resp = stub.GetDevices(agent_pb2.GetDevicesRequest(), timeout=5)
    return [(g.index, g.power_limit_w) for g in resp.gpus]


_caps = st.lists(st.builds(
    lambda node, index, w, mhz: types_pb2.PowerCap(gpu=types_pb2.GpuRef(node=node, index=index),
                                                   cap_w=w, locked_sm_clock_mhz=mhz),
    st.sampled_from([NODE, "", "other-node"]) | _text, st.integers(0, 6) | _u32,
    _f64 | st.floats(150, 1000), st.sampled_from([0, 1500, 1980, 5000]) | _u32,
), max_size=6)
_valid_caps = st.lists(st.builds(
    lambda index, w: types_pb2.PowerCap(gpu=types_pb2.GpuRef(node=NODE, index=index), cap_w=w),
    st.integers(0, 3), st.floats(200, 910)), min_size=1, max_size=4, unique_by=lambda c: c.gpu.index)
_agent_calls = st.one_of(
    st.tuples(st.just("ApplyPowerPlan"), st.builds(lambda g, c: agent_pb2.ApplyPowerPlanRequest(
        generation=g, caps=c), st.integers(1, 2**40), _valid_caps)),
    st.tuples(st.just("ApplyPowerPlan"), st.builds(lambda g, c: agent_pb2.ApplyPowerPlanRequest(
        generation=g, caps=c), st.integers(0, 3) | _u64, _caps)),
    st.tuples(st.just("ResetToDefaults"), st.builds(
        lambda g: agent_pb2.ResetToDefaultsRequest(generation=g), st.integers(0, 3) | _u64)),
    st.tuples(st.just("InjectFault"), st.builds(
        lambda i, k, f: agent_pb2.InjectFaultRequest(index=i, kind=k, slow_factor=f),
        st.integers(0, 6) | _u32, st.sampled_from(["xid79", "slow", "bogus", ""]) | _text, _f64)),
)


def test_generated_agent_calls_are_answered_and_rejections_touch_no_device(agent):
    stub, proc = agent
    tally: dict[str, int] = {}

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(call=_agent_calls)
    def check(call):
        method, request = call
        before = _device_state(stub)
        rejected = _counted(tally, method, lambda: getattr(stub, method)(request, timeout=5))
        if rejected:
            assert _device_state(stub) == before, (method, request)
        elif method == "InjectFault":
            stub.InjectFault(agent_pb2.InjectFaultRequest(index=request.index, kind="recover"), timeout=5)
        assert proc.proc.poll() is None, proc.stderr()

    check()
    assert tally.get("ApplyPowerPlan_rejected") and tally.get("InjectFault_rejected")
    record("grpc_agent_fuzz", "150 hypothesis-generated ApplyPowerPlan / ResetToDefaults / InjectFault "
           "requests (NaN/inf/out-of-range caps, foreign nodes, bad indexes, unknown fault kinds) to a "
           "real agent process", "no crash; every rejection a known status code with a message; a "
           "rejected call leaves every GPU's power limit unchanged", tally)


# ---- controller Trainer service ----


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from tests.support.etcd_server import EtcdCluster

    cluster = EtcdCluster(1, tmp_path_factory.mktemp("rel-trainer") / "etcd").start()
    etcd = Etcd(cluster.endpoints, timeout=2.0)
    racks = small_cluster(etcd)
    put_job(etcd, racks)
    server, port = create_grpc_server(etcd)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield controller_pb2_grpc.TrainerStub(channel), etcd
    finally:
        channel.close()
        server.stop(0)
        etcd.close()
        cluster.stop()


_jobs = st.sampled_from(["job1", "job2", "", "a/b", "x" * 200]) | _text
_specs = st.builds(
    lambda name, t, racks, units, min_tp, policy, lb: types_pb2.JobSpec(
        name=name, base_tp=t, min_tp=min_tp, policy=policy, local_batch=lb, global_batch=lb,
        replicas=[types_pb2.ReplicaSpec(stages=[types_pb2.StageSpec(rack=r)]) for r in racks],
        units=[types_pb2.UnitFamily(name=k, count=c, bytes_per_unit=1) for k, c in units]),
    _jobs, st.integers(0, 8) | _u32, st.lists(st.sampled_from(["rack0", "rack1", "nope"]) | _text, max_size=3),
    st.lists(st.tuples(st.sampled_from(["heads", "ffn"]) | _text, _u32), max_size=3),
    st.integers(0, 5) | _u32, st.sampled_from(["ntp-pw", "spare", "bogus"]) | _text, _u32,
)
_trainer_calls = st.one_of(
    st.tuples(st.just("RegisterJob"), st.builds(lambda s: controller_pb2.RegisterJobRequest(spec=s), _specs)),
    st.tuples(st.just("AckPlan"), st.builds(
        lambda j, r, g, t: types_pb2.Ack(job=j, rank=r, generation=g, reshard_seconds=t),
        _jobs, st.integers(0, 9) | _u32, st.integers(0, 3) | _u64, _f64)),
    st.tuples(st.just("ReportStep"), st.builds(
        lambda j, r, s, t, n, loss: controller_pb2.StepReport(job=j, rank=r, step=s, step_seconds=t,
                                                             samples=n, loss=loss),
        _jobs, _u32, _u64, _f64, _u32, _f64)),
    st.tuples(st.just("WatchPlan"), st.builds(
        lambda j, g, r: controller_pb2.WatchPlanRequest(job=j, after_generation=g, rank=r), _jobs, _u64, _u32)),
)


def test_generated_trainer_calls_are_answered_and_rejections_write_nothing(trainer):
    stub, etcd = trainer
    tally: dict[str, int] = {}

    def invoke(method, request):
        if method == "WatchPlan":  # a stream: the first answer (or the refusal) is enough
            call = stub.WatchPlan(request, timeout=0.5)
            try:
                next(call)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
            except StopIteration:
                pass
            finally:
                call.cancel()
        else:
            getattr(stub, method)(request, timeout=5)

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(call=_trainer_calls)
    def check(call):
        method, request = call
        rev = etcd.get_prefix("/tpflex/v1/")[1]
        if _counted(tally, method, lambda: invoke(method, request)):
            assert etcd.get_prefix("/tpflex/v1/")[1] == rev, (method, request)

    check()
    assert tally.get("RegisterJob_rejected") and tally.get("AckPlan_rejected")
    record("grpc_trainer_fuzz", "150 hypothesis-generated RegisterJob / AckPlan / ReportStep / WatchPlan "
           "requests (bad names, unknown racks, zero/huge degrees, NaN times, future generations) to the "
           "controller's Trainer service", "no crash; every rejection a known status code with a message; "
           "a rejected call leaves the etcd revision unchanged", tally)
