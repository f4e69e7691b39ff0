"""A GPU that has fallen off the bus when the agent starts (NVML GPU_IS_LOST from the
first per-device call): the agent starts, registers the node, reports that GPU FAILED and
unreadable, as it does for a GPU lost while it runs, and caps the healthy ones."""

from __future__ import annotations

import threading

import pytest
from tpflex_proto import codec, keys, types_pb2

from tests.agent.support import AgentProcess, FakeNvml, build_fake_nvml, wait_until
from tests.agent.test_power_order import metric
from tests.agent.test_process import agent_args, device_limits, put_plan

pytestmark = pytest.mark.slow


def test_agent_starts_with_a_gpu_lost_and_reports_it_failed(etcd_server, etcd, tmp_path):
    build_fake_nvml()
    fake = FakeNvml(tmp_path / "nvml.state", count=3).set(1, lost=1)
    put_plan(etcd, "l1", 1, {0: 500.0, 1: 650.0, 2: 600.0})
    failed = threading.Event()

    def on_events(events):
        for ev in events:
            if ev.kind == "put" and ev.key == keys.health("l1"):
                h = codec.decode(types_pb2.NodeHealth, ev.value, ev.key)
                states = [g.state for g in h.gpus]
                if states == [types_pb2.GPU_HEALTHY, types_pb2.GPU_FAILED, types_pb2.GPU_HEALTHY]:
                    failed.set()

    w = etcd.watch_prefix(keys.health("l1"), on_events)
    try:
        assert w.established.wait(5)
        with AgentProcess(agent_args("l1", etcd_server, "--backend", "nvml", "--power-check-s", "0.2"), env=fake.env()) as a:
            assert failed.wait(10), a.stderr()
            node = wait_until(lambda: etcd.get(keys.node("l1")), 10, "l1 registered")
            gpus = codec.decode(types_pb2.Node, node.value, node.key).gpus
            assert [g.index for g in gpus] == [0, 1, 2]
            assert [g.uuid for g in gpus] == ["GPU-fake-0000", "", "GPU-fake-0002"]
            # the healthy GPUs are capped; the lost one's write fails (a PARTIAL plan)
            wait_until(lambda: [device_limits(a.grpc_address)[i] for i in (0, 2)] == [500.0, 600.0], 10,
                       "healthy GPUs capped")
            readable = {gpu: metric(a.metrics_port, "tpflex_gpu_readable", gpu=gpu) for gpu in "012"}
            assert readable == {"0": 1.0, "1": 0.0, "2": 1.0}
            fake.set(1, lost=0)  # back on the bus: the next write of the desired caps takes
            wait_until(lambda: device_limits(a.grpc_address) == [500.0, 650.0, 600.0], 15, "GPU 1 capped")
            assert a.terminate() == 0, a.stderr()
    finally:
        w.cancel()
