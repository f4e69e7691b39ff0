"""Power caps reach the real agent's gRPC service: retried with backoff until the agent
comes up, idempotent by generation, recorded as the rollout's power_applied phase."""

from __future__ import annotations

import threading
import time

import grpc
from tpflex_agent.service import create_server
from tpflex_agent.settings import AgentSection, AgentSettings, GrpcSection
from tpflex_agent.sim import SimGpuSpec, SimulatedBackend
from tpflex_controller import synthetic
from tpflex_controller.agent_client import AgentPusher
from tpflex_controller.cache import NodePower
from tpflex_proto import agent_pb2, agent_pb2_grpc, codec, keys, types_pb2

from tests.controller.controller_harness import PlanWatcher, fail_gpu, put_job, start_controller
from tests.support.ports import free_ports

TDP, MAX = 700.0, 910.0


def _start_agent(node: str, rack: str, port: int):
    settings = AgentSettings(
        agent=AgentSection(node=node, rack=rack, backend="sim", sim_gpus=2),
        grpc=GrpcSection(listen=f"127.0.0.1:{port}", insecure=True),
    )
    backend = SimulatedBackend(2, spec=SimGpuSpec(tdp_w=TDP), node=node)
    server, bound = create_server(settings, backend)
    assert bound == port
    server.start()
    return server


def _limits(port: int) -> dict[int, float]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = agent_pb2_grpc.AgentStub(ch).GetDevices(agent_pb2.GetDevicesRequest(), timeout=5)
    return {g.index: g.power_limit_w for g in resp.gpus}


def _event(etcd, job: str, generation: int) -> types_pb2.Event | None:
    kvs, _ = etcd.get_prefix(keys.EVENTS)
    for kv in kvs:
        ev = codec.decode(types_pb2.Event, kv.value)
        if ev.job == job and ev.generation == generation and ev.kind == "plan_committed":
            return ev
    return None


def test_power_caps_retried_until_the_agent_applies_them(etcd_server, etcd):
    racks = [synthetic.rack(f"rack{i}", 2, 2, tdp_w=TDP, min_w=200, max_w=MAX) for i in range(2)]
    ports = dict(zip(racks[1].nodes, free_ports(2), strict=True))
    addresses = {n: f"127.0.0.1:{p}" for n, p in ports.items()}
    synthetic.store_cluster(etcd, racks, agent_addresses=addresses)
    put_job(etcd, racks)
    watcher = PlanWatcher(etcd, "job1")
    ctl = start_controller(etcd_server.endpoints)
    agents = []
    try:
        watcher.wait_generation(1)
        fail_gpu(etcd, "rack1-n00", 2, {1})
        plan = watcher.wait_generation(2)
        assert plan.power_caps, "the degraded rack should be boosted"
        failures = ctl.registry.get_sample_value("tpflex_agent_push_failures_total")
        deadline = time.monotonic() + 10
        while failures < 2 and time.monotonic() < deadline:  # pushes to absent agents retried
            time.sleep(0.05)
            failures = ctl.registry.get_sample_value("tpflex_agent_push_failures_total")
        assert failures >= 2
        agents = [_start_agent(n, "rack1", p) for n, p in ports.items()]
        deadline = time.monotonic() + 15
        ev = None
        while time.monotonic() < deadline:
            ev = _event(etcd, "job1", 2)
            if ev is not None and "power_applied" in {p.phase for p in ev.phases}:
                break
            time.sleep(0.05)
        assert ev is not None and "power_applied" in {p.phase for p in ev.phases}, ev
        for node, port in ports.items():
            desired = codec.decode(types_pb2.NodePowerPlan, etcd.get(keys.power(node)).value)
            assert _limits(port) == {c.gpu.index: c.cap_w for c in desired.caps}
        assert max(_limits(ports["rack1-n01"]).values()) > TDP  # boosted
        hist = ctl.registry.get_sample_value(
            "tpflex_reconfiguration_seconds_count", {"phase": "power_applied"}
        )
        assert hist == 2.0  # generation 1 (no caps to send) and generation 2
    finally:
        ctl.stop()
        watcher.close()
        for a in agents:
            a.stop(grace=0).wait()


def _recording_pusher():
    """A pusher with fast retries, the results it reports, and an event set on each."""
    results = []
    done = threading.Event()

    def on_result(r):
        results.append(r)
        done.set()

    return AgentPusher(on_result, timeout=1.0, backoff_initial=0.05, backoff_max=0.2), results, done


def test_pusher_sends_only_the_newest_plan_and_reports_refusals(etcd):
    (port,) = free_ports(1)
    pusher, results, done = _recording_pusher()
    agent = None
    try:
        caps = lambda w: tuple((i, float(w)) for i in range(2))  # noqa: E731
        pusher.push("n0", f"127.0.0.1:{port}", NodePower(1, caps(750)))
        pusher.push("n0", f"127.0.0.1:{port}", NodePower(2, caps(800)))
        time.sleep(0.3)  # let a few attempts fail against the closed port
        agent = _start_agent("n0", "r", port)
        assert done.wait(10)
        assert [(r.generation, r.ok, r.outcome) for r in results] == [(2, True, "APPLIED")]
        assert results[0].attempts >= 2
        assert _limits(port) == {0: 800.0, 1: 800.0}

        done.clear()
        pusher.push("n0", f"127.0.0.1:{port}", NodePower(1, caps(750)))
        assert done.wait(10)
        stale = results[-1]
        assert not stale.ok and stale.outcome == "FAILED_PRECONDITION" and "stale" in stale.detail
        assert _limits(port) == {0: 800.0, 1: 800.0}  # the refused plan changed nothing
    finally:
        pusher.close()
        if agent is not None:
            agent.stop(grace=0).wait()


def test_a_plan_for_an_agent_not_yet_known_is_sent_when_it_registers():
    """A node whose agent address is not known yet ("") keeps its newest plan; the
    address, once known (the node registers), sends that plan, and only that one."""
    (port,) = free_ports(1)
    pusher, results, done = _recording_pusher()
    agent = _start_agent("n0", "r", port)
    try:
        pusher.push("n0", "", NodePower(1, ((0, 700.0), (1, 700.0))))
        pusher.push("n0", "", NodePower(2, ((0, 850.0), (1, 900.0))))
        assert pusher.pending() == {"n0": 2}
        assert _limits(port) == {0: TDP, 1: TDP}  # nothing sent: no address
        pusher.set_address("n0", f"127.0.0.1:{port}")
        assert done.wait(10)
        assert [(r.generation, r.ok, r.outcome) for r in results] == [(2, True, "APPLIED")]
        assert _limits(port) == {0: 850.0, 1: 900.0}
    finally:
        pusher.close()
        agent.stop(grace=0).wait()
