"""The agent gRPC service over a real server and channel, simulated GPUs."""

from __future__ import annotations

import math
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tpflex_proto import agent_pb2, types_pb2

OUT = agent_pb2.ApplyPowerPlanResponse


def plan(gen: int, *caps) -> agent_pb2.ApplyPowerPlanRequest:
    req = agent_pb2.ApplyPowerPlanRequest(generation=gen)
    for cap in caps:
        index, watts, *rest = cap
        req.caps.add(gpu=types_pb2.GpuRef(node=rest[1] if len(rest) > 1 else "n1", index=index),
                     cap_w=watts, locked_sm_clock_mhz=rest[0] if rest else 0)
    return req


def limits(agent) -> list[float]:
    return [agent.backend.read(i).power_limit_w for i in range(4)]


def writes(agent) -> list[int]:
    return [agent.backend.write_count(i) for i in range(4)]


def test_get_devices(agent):
    resp = agent.stub.GetDevices(agent_pb2.GetDevicesRequest(), timeout=5)
    assert (resp.node, resp.rack, resp.backend) == ("n1", "r1", "sim")
    assert [g.index for g in resp.gpus] == [0, 1, 2, 3]
    g = resp.gpus[0]
    assert g.min_limit_w < g.default_limit_w == g.power_limit_w < g.max_limit_w
    assert [h.state for h in resp.health.gpus] == [types_pb2.GPU_HEALTHY] * 4


def test_apply_plan_is_idempotent_and_rejects_stale_generations(agent):
    resp = agent.stub.ApplyPowerPlan(plan(3, (1, 800.0), (2, 850.0, 1500)), timeout=5)
    assert resp.outcome == OUT.APPLIED and resp.generation == 3
    assert [(g.index, g.ok, g.applied_cap_w, g.locked_sm_clock_mhz) for g in resp.gpus] == [
        (0, True, 700.0, 0), (1, True, 800.0, 0), (2, True, 850.0, 1500), (3, True, 700.0, 0)]
    assert limits(agent) == [700.0, 800.0, 850.0, 700.0]
    assert agent.backend.read(2).locked_sm_clock_mhz == 1500
    before = writes(agent)
    again = agent.stub.ApplyPowerPlan(plan(3, (1, 800.0), (2, 850.0, 1500)), timeout=5)
    assert again.outcome == OUT.ALREADY_APPLIED and writes(agent) == before
    with pytest.raises(grpc.RpcError) as err:
        agent.stub.ApplyPowerPlan(plan(2, (1, 900.0)), timeout=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "stale generation 2" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        agent.stub.ApplyPowerPlan(plan(3, (1, 900.0)), timeout=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert limits(agent) == [700.0, 800.0, 850.0, 700.0] and writes(agent) == before
    nxt = agent.stub.ApplyPowerPlan(plan(4, (1, 780.0)), timeout=5)
    assert nxt.outcome == OUT.APPLIED and limits(agent) == [700.0, 780.0, 700.0, 700.0]
    assert agent.backend.read(2).locked_sm_clock_mhz == 0


@pytest.mark.parametrize("bad,words", [
    ((3, 5000.0), "outside the device's range"),
    ((3, 10.0), "outside the device's range"),
    ((9, 700.0), "unknown GPU index 9"),
    ((3, math.nan), "not a finite number"),
    ((3, 700.0, 0, "other-node"), "sent to node n1"),
    ((3, 700.0, 99999), "locked SM clock"),
])
def test_bad_values_are_rejected_and_touch_no_device(agent, bad, words):
    agent.stub.ApplyPowerPlan(plan(1, (0, 650.0)), timeout=5)
    before_limits, before_writes = limits(agent), writes(agent)
    with pytest.raises(grpc.RpcError) as err:
        agent.stub.ApplyPowerPlan(plan(2, (1, 800.0), bad), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.value.details()
    assert limits(agent) == before_limits and writes(agent) == before_writes
    # the refused generation was not recorded: it can still be applied correctly
    assert agent.stub.ApplyPowerPlan(plan(2, (1, 800.0)), timeout=5).outcome == OUT.APPLIED


def test_generation_zero_is_invalid(agent):
    with pytest.raises(grpc.RpcError) as err:
        agent.stub.ApplyPowerPlan(plan(0), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_device_failing_mid_plan_is_partial_then_retried(agent):
    agent.backend.deny_writes(2)
    resp = agent.stub.ApplyPowerPlan(plan(7, (1, 850.0), (2, 850.0)), timeout=5)
    assert resp.outcome == OUT.PARTIAL
    status = {g.index: g for g in resp.gpus}
    assert status[1].ok and status[1].applied_cap_w == 850.0
    assert not status[2].ok and "NO_PERMISSION" in status[2].error
    assert limits(agent) == [700.0, 850.0, 700.0, 700.0]
    agent.backend.deny_writes(2, False)
    retry = agent.stub.ApplyPowerPlan(plan(7, (1, 850.0), (2, 850.0)), timeout=5)
    assert retry.outcome == OUT.APPLIED and limits(agent) == [700.0, 850.0, 850.0, 700.0]


def test_reset_to_defaults(agent):
    agent.stub.ApplyPowerPlan(plan(1, (0, 900.0, 1200), (3, 300.0)), timeout=5)
    resp = agent.stub.ResetToDefaults(agent_pb2.ResetToDefaultsRequest(generation=2), timeout=5)
    assert resp.outcome == OUT.APPLIED and limits(agent) == [700.0] * 4
    assert agent.backend.read(0).locked_sm_clock_mhz == 0
    with pytest.raises(grpc.RpcError) as err:
        agent.stub.ResetToDefaults(agent_pb2.ResetToDefaultsRequest(generation=1), timeout=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_inject_fault_reaches_watch_health_stream(agent):
    stream = agent.stub.WatchHealth(agent_pb2.WatchHealthRequest(), timeout=10)
    first = next(stream)
    assert [g.state for g in first.gpus] == [types_pb2.GPU_HEALTHY] * 4
    seen = threading.Event()
    got: list[types_pb2.NodeHealth] = []

    def read():
        for h in stream:
            got.append(h)
            if h.gpus[1].state == types_pb2.GPU_FAILED:
                seen.set()
                return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    resp = agent.stub.InjectFault(agent_pb2.InjectFaultRequest(index=1, kind="xid79"), timeout=5)
    assert resp.health.gpus[1].state == types_pb2.GPU_FAILED
    assert list(resp.health.gpus[1].xids) == [79] and "xid 79" in resp.health.gpus[1].reason
    assert seen.wait(5), got
    assert got[-1].seq > first.seq and got[-1].gpus[0].state == types_pb2.GPU_HEALTHY
    stream.cancel()
    rec = agent.stub.InjectFault(agent_pb2.InjectFaultRequest(index=1, kind="recover"), timeout=5)
    assert rec.health.gpus[1].state == types_pb2.GPU_HEALTHY and not rec.health.gpus[1].xids


@pytest.mark.parametrize("req,words", [
    (agent_pb2.InjectFaultRequest(index=1, kind="melt"), "unknown fault kind"),
    (agent_pb2.InjectFaultRequest(index=17, kind="xid79"), "unknown GPU index 17"),
    (agent_pb2.InjectFaultRequest(index=1, kind="slow", slow_factor=1.5), "slow_factor"),
])
def test_bad_fault_requests(agent, req, words):
    with pytest.raises(grpc.RpcError) as err:
        agent.stub.InjectFault(req, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()
    h = agent.stub.GetDevices(agent_pb2.GetDevicesRequest(), timeout=5).health
    assert [g.state for g in h.gpus] == [types_pb2.GPU_HEALTHY] * 4


def test_thermal_and_slow_faults_degrade(agent):
    h = agent.stub.InjectFault(agent_pb2.InjectFaultRequest(index=0, kind="thermal"), timeout=5).health
    assert h.gpus[0].state == types_pb2.GPU_DEGRADED and h.gpus[0].temperature_c >= 90
    h = agent.stub.InjectFault(agent_pb2.InjectFaultRequest(index=3, kind="slow", slow_factor=0.5), timeout=5).health
    assert h.gpus[3].state == types_pb2.GPU_DEGRADED and h.gpus[3].relative_speed == 0.5


def test_standard_grpc_health_service(agent):
    stub = health_pb2_grpc.HealthStub(agent.channel)
    for service in ("", "tpflex.v1.Agent"):
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    agent.core.grpc_health.enter_graceful_shutdown()
    resp = stub.Check(health_pb2.HealthCheckRequest(service="tpflex.v1.Agent"), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
