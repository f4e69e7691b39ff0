"""The desired caps in etcd (``power/<node>``) that the agent must not take as its new
desired state: a value that decodes but is not valid on the node's devices keeps the last
good desired state, and that state's failed write is still written again; a deleted key
(every GPU back at its default) is no generation regression."""

from __future__ import annotations

import pytest
from tpflex_agent.desired import PowerAuthority
from tpflex_proto import keys

from tests.agent.conftest import sim_settings, start_agent, stop_agent
from tests.agent.support import AgentProcess, FakeNvml, build_fake_nvml, wait_until
from tests.agent.test_power_order import metric
from tests.agent.test_process import agent_args, device_limits, put_plan


@pytest.mark.slow
def test_invalid_desired_caps_keep_the_last_good_state_and_its_retry(etcd_server, etcd, tmp_path):
    build_fake_nvml()
    fake = FakeNvml(tmp_path / "nvml.state", count=2).set(1, deny_set=1)  # GPU 1 refuses limits
    put_plan(etcd, "v1", 2, {0: 450.0, 1: 400.0})
    args = agent_args("v1", etcd_server, "--backend", "nvml", "--power-check-s", "0.2")
    with AgentProcess(args, env=fake.env(tmp_path / "nvml.log")) as a:
        divergent = 'tpflex_agent_power_divergent_gpus'
        wait_until(lambda: metric(a.metrics_port, divergent) == 1, 10, "GPU 1 measured as divergent")
        assert device_limits(a.grpc_address) == [450.0, 700.0]
        put_plan(etcd, "v1", 3, {0: 5000.0})  # decodes, but above the device's 900 W
        wait_until(lambda: "generation=3 code=INVALID_ARGUMENT" in a.stderr(), 10, "generation 3 refused")
        assert metric(a.metrics_port, "tpflex_agent_desired_power_generation") == 2
        assert metric(a.metrics_port, divergent) == 1  # still away from generation 2's cap
        fake.set(1, deny_set=0)  # the device takes limits again: a check writes it again
        wait_until(lambda: device_limits(a.grpc_address) == [450.0, 400.0], 10,
                   "GPU 1 written again to the last good desired cap")
        assert metric(a.metrics_port, divergent) == 0
        assert metric(a.metrics_port, "tpflex_agent_power_corrections_total") >= 1
        assert a.terminate() == 0, a.stderr()


def test_deleted_desired_caps_are_no_generation_regression(etcd, caplog):
    a = start_agent(sim_settings(node="d1", gpus=2))
    put_plan(etcd, "d1", 4, {1: 850.0})
    authority = a.core.authority = PowerAuthority(etcd, a.core, check_s=0.2).start()
    try:
        assert authority.ready.wait(5)
        assert [a.backend.read(i).power_limit_w for i in range(2)] == [700.0, 850.0]
        etcd.delete(keys.power("d1"))  # the controller's "no desired caps": every GPU at its default
        wait_until(lambda: a.core.power.applied_targets()[1].cap_w == 700.0 and authority.desired.generation == 0,
                   5, "defaults applied")
        assert [a.backend.read(i).power_limit_w for i in range(2)] == [700.0, 700.0]
        assert a.core.power.regressions == 0
        assert "went back" not in caplog.text
    finally:
        authority.stop()
        stop_agent(a)
