"""Down before up (docs/agent.md "Power plans") when the caps come from etcd: a real
tpflex-agent over the fake libnvidia-ml and a real etcd; the order is the order of the
set-power-limit calls the fake library logs (FAKE_NVML_LOG)."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.agent.support import AgentProcess, FakeNvml, build_fake_nvml, wait_until
from tests.agent.test_process import agent_args, device_limits, put_plan

pytestmark = pytest.mark.slow


def set_calls(log: Path, start: int = 0) -> list[tuple[int, int]]:
    """(gpu, mW) of every set-power-limit call logged after byte ``start``."""
    text = log.read_text()[start:] if log.exists() else ""
    return [(int(f[1]), int(f[2])) for f in (ln.split() for ln in text.splitlines())
            if f and f[0] == "set_power_limit"]


def metric(port: int, name: str, **labels: str) -> float:
    """The first sample ``name`` on the agent's /metrics whose labels include ``labels``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == name and labels.items() <= s.labels.items())


def assert_down_before_up(calls: list[tuple[int, int]], down: set[int], up: set[int]) -> None:
    order = [gpu for gpu, _ in calls]
    assert down | up <= set(order), f"a changed GPU was not written: {calls}"
    assert max(order.index(i) for i in down) < min(order.index(i) for i in up), \
        f"a GPU went up before one went down: {calls}"
    assert sorted(order) == sorted(down | up), f"each changed GPU written once, nothing else: {calls}"


# GPUs 0 and 2 go up, 1 and 3 go down, 4 stays: index order would write 0 (up) first.
OLD = {0: 400.0, 1: 800.0, 2: 400.0, 3: 800.0, 4: 600.0}
NEW = {0: 800.0, 1: 400.0, 2: 800.0, 3: 400.0, 4: 600.0}


def test_etcd_plan_change_writes_decreases_first_and_leaves_unchanged_gpus(etcd_server, etcd, tmp_path):
    build_fake_nvml()
    fake = FakeNvml(tmp_path / "nvml.state", count=5)
    log = tmp_path / "nvml.log"
    put_plan(etcd, "o1", 1, OLD)
    with AgentProcess(agent_args("o1", etcd_server, "--backend", "nvml"), env=fake.env(log)) as a:
        wait_until(lambda: device_limits(a.grpc_address) == list(OLD.values()), 10, "generation 1 applied")
        start = log.stat().st_size
        put_plan(etcd, "o1", 2, NEW)
        wait_until(lambda: device_limits(a.grpc_address) == list(NEW.values()), 10, "generation 2 applied")
        assert_down_before_up(set_calls(log, start), down={1, 3}, up={0, 2})
        # a plan change is no correction: no device had left the desired caps
        assert metric(a.metrics_port, "tpflex_agent_power_corrections_total") == 0
        assert a.terminate() == 0, a.stderr()
        assert "left the desired caps" not in a.stderr()


def test_restart_writes_decreases_first_from_the_limits_the_devices_hold(etcd_server, etcd, tmp_path):
    build_fake_nvml()
    fake = FakeNvml(tmp_path / "nvml.state", count=5)
    for i, w in OLD.items():  # the driver still holds generation 1's limits when the agent starts
        fake.set(i, limit_mw=int(w * 1000))
    log = tmp_path / "nvml.log"
    put_plan(etcd, "o2", 2, NEW)  # written by the controller while the agent was down
    with AgentProcess(agent_args("o2", etcd_server, "--backend", "nvml"), env=fake.env(log)) as a:
        wait_until(lambda: device_limits(a.grpc_address) == list(NEW.values()), 10, "generation 2 applied")
        assert_down_before_up(set_calls(log), down={1, 3}, up={0, 2})
        assert metric(a.metrics_port, "tpflex_agent_power_corrections_total") == 0
        assert a.terminate() == 0, a.stderr()
