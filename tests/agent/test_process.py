"""Real tpflex-agent processes against a real etcd: lease lapse on kill -9, desired caps
re-applied on restart, graceful SIGTERM, and the NVML backend over the fake library."""

from __future__ import annotations

import socket
import threading
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tpflex_proto import agent_pb2, agent_pb2_grpc, codec, keys, types_pb2

from tests.agent.support import AgentProcess, FakeNvml, build_fake_nvml, wait_until

pytestmark = pytest.mark.slow


def agent_args(node: str, etcd_server, *extra: str) -> list[str]:
    return ["--node", node, "--rack", "r1", "--etcd", ",".join(etcd_server.endpoints),
            "--listen", "127.0.0.1:0", "--insecure", "--metrics-listen", "127.0.0.1:0",
            "--health-poll-s", "0.1", *extra]


def put_plan(etcd, node: str, gen: int, caps: dict[int, float]) -> None:
    p = types_pb2.NodePowerPlan(node=node, generation=gen)
    for i, w in caps.items():
        p.caps.add(gpu=types_pb2.GpuRef(node=node, index=i), cap_w=w)
    etcd.put(keys.power(node), codec.encode(p))


def device_limits(address: str) -> list[float]:
    with grpc.insecure_channel(address) as ch:
        resp = agent_pb2_grpc.AgentStub(ch).GetDevices(agent_pb2.GetDevicesRequest(), timeout=5)
    return [g.power_limit_w for g in resp.gpus]


def key_deleted(etcd, key: str) -> threading.Event:
    gone = threading.Event()
    w = etcd.watch_prefix(key, lambda evs: any(e.kind == "delete" and e.key == key for e in evs) and gone.set())
    assert w.established.wait(5)
    gone.watch = w
    return gone


def test_kill9_lapses_lease_restart_reapplies_desired_caps_sigterm_revokes(etcd_server, etcd):
    put_plan(etcd, "p1", 3, {1: 850.0})
    sim = ["--backend", "sim", "--sim-gpus", "4"]
    with AgentProcess(agent_args("p1", etcd_server, *sim, "--lease-ttl-s", "1")) as a:
        wait_until(lambda: etcd.get(keys.node("p1")), 10, "p1 registered")
        wait_until(lambda: device_limits(a.grpc_address) == [700.0, 850.0, 700.0, 700.0], 10,
                   "desired caps applied at start-up")
        gone = key_deleted(etcd, keys.node("p1"))
        a.proc.kill()  # SIGKILL: no chance to revoke
        a.proc.wait(5)
        assert gone.wait(10), "nodes/p1 still present after its 1 s lease should have lapsed"
        gone.watch.cancel()
        assert etcd.get(keys.health("p1")) is None
    put_plan(etcd, "p1", 4, {2: 880.0})  # written by the controller while the agent is down
    with AgentProcess(agent_args("p1", etcd_server, *sim, "--lease-ttl-s", "30")) as b:
        wait_until(lambda: etcd.get(keys.node("p1")), 10, "p1 registered again")
        wait_until(lambda: device_limits(b.grpc_address) == [700.0, 700.0, 880.0, 700.0], 10,
                   "restarted agent re-applies the desired caps")
        gone = key_deleted(etcd, keys.node("p1"))
        assert b.terminate() == 0, b.stderr()
        assert gone.wait(5), "SIGTERM did not revoke the 30 s lease"
        gone.watch.cancel()
        assert "lease revoked" in b.stderr()


def test_nvml_agent_process_on_the_fake_library(etcd_server, etcd, tmp_path):
    build_fake_nvml()
    fake = FakeNvml(tmp_path / "nvml.state", count=2)
    log = tmp_path / "nvml.log"
    args = agent_args("g1", etcd_server, "--backend", "nvml", "--lease-ttl-s", "2")
    with AgentProcess(args, env=fake.env(log)) as a, grpc.insecure_channel(a.grpc_address) as ch:
        stub = agent_pb2_grpc.AgentStub(ch)
        dev = stub.GetDevices(agent_pb2.GetDevicesRequest(), timeout=5)
        assert dev.backend == "nvml" and [g.name for g in dev.gpus] == ["NVIDIA H100 80GB HBM3"] * 2
        assert [(g.default_limit_w, g.max_limit_w) for g in dev.gpus] == [(700.0, 900.0)] * 2

        with pytest.raises(grpc.RpcError) as err:
            stub.InjectFault(agent_pb2.InjectFaultRequest(index=0, kind="xid79"), timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "only available on the simulated backend" in err.value.details()

        bad = agent_pb2.ApplyPowerPlanRequest(generation=1)
        bad.caps.add(gpu=types_pb2.GpuRef(index=0), cap_w=800.0)
        bad.caps.add(gpu=types_pb2.GpuRef(index=1), cap_w=950.0)
        # the agent's own start-up reconcile may set the default caps at any moment; the
        # refused request must set neither of its caps (800 W, 950 W in mW in the log)
        bad_sets = lambda: [ln for ln in (log.read_text() if log.exists() else "").splitlines()  # noqa: E731
                            if ln.startswith("set_power_limit") and ln.split()[2] in ("800000", "950000")]
        with pytest.raises(grpc.RpcError) as err:
            stub.ApplyPowerPlan(bad, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_sets() == []  # no device touched

        fake.set(1, deny_set=1)
        put_plan(etcd, "g1", 2, {0: 800.0, 1: 820.0})  # the controller's desired caps, then its push
        req = agent_pb2.ApplyPowerPlanRequest(generation=2)
        req.caps.add(gpu=types_pb2.GpuRef(index=0), cap_w=800.0)
        req.caps.add(gpu=types_pb2.GpuRef(index=1), cap_w=820.0)
        resp = stub.ApplyPowerPlan(req, timeout=5)
        assert resp.outcome == agent_pb2.ApplyPowerPlanResponse.PARTIAL
        assert resp.gpus[0].ok and resp.gpus[0].applied_cap_w == 800.0
        assert not resp.gpus[1].ok and "NO_PERMISSION" in resp.gpus[1].error
        assert "set_power_limit 0 800000 0 rc=0" in log.read_text()
        assert "set_power_limit 1 820000 0 rc=4" in log.read_text()

        wait_until(lambda: etcd.get(keys.health("g1")), 10, "g1 health record")
        failed = threading.Event()

        def on_events(events):
            for ev in events:
                if ev.kind == "put":
                    h = codec.decode(types_pb2.NodeHealth, ev.value)
                    if h.gpus[0].state == types_pb2.GPU_FAILED and 79 in h.gpus[0].xids:
                        failed.set()

        w = etcd.watch_prefix(keys.health("g1"), on_events)
        try:
            assert w.established.wait(5)
            fake.xid(0, 79, lost=1)
            assert failed.wait(5), a.stderr()
        finally:
            w.cancel()
        with urllib.request.urlopen(f"http://127.0.0.1:{a.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}

        def gpu(index: int, **extra) -> tuple:  # dcgm-exporter's label names: gpu, UUID, Hostname
            labels = {"gpu": str(index), "node": "g1", "UUID": f"GPU-fake-000{index}",
                      "Hostname": socket.gethostname(), **extra}
            return tuple(sorted(labels.items()))

        assert samples[("tpflex_gpu_health_state", gpu(0, state="failed"))] == 1.0
        assert samples[("tpflex_gpu_xid_errors_total", gpu(0))] == 1.0
        assert samples[("tpflex_gpu_power_limit_watts", gpu(1))] == 700.0
        assert "tpflex_agent_registered 1.0" in text and "tpflex_agent_power_plan_generation 2.0" in text
        assert a.terminate() == 0, a.stderr()
