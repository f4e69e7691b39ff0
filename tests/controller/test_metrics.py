"""The controller's metrics follow the decisions; label sets are pre-created at zero; the
exposition passes promtool's lint."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from tpflex_controller.metrics import CAUSES, PHASES, ControllerMetrics

from tests.controller.controller_harness import (
    controller_on_job,
    eventually,
    fail_gpu,
)


def test_metrics_follow_a_gpu_failure(etcd_server, etcd):
    with controller_on_job(etcd_server, etcd) as (_, watcher, ctl):
        value = ctl.registry.get_sample_value
        watcher.wait_generation(1)
        for cause in CAUSES:  # pre-created at zero
            assert value("tpflex_reconfigurations_total", {"job": "job1", "cause": cause}) is not None
        fail_gpu(etcd, "rack1-n00", 2, {1})
        plan = watcher.wait_generation(2)
        assert value("tpflex_controller_is_leader") == 1.0
        # the loop updates metrics right after its commit, which the watcher may see first
        eventually(lambda: value("tpflex_reconfiguration_seconds_count", {"phase": "committed"}) == 2.0)
        assert value("tpflex_plan_generation", {"job": "job1"}) == 2.0
        assert value("tpflex_replica_tp_degree", {"job": "job1", "replica": "1"}) == 3.0
        assert value("tpflex_replica_tp_degree", {"job": "job1", "replica": "0"}) == 4.0
        assert value("tpflex_rack_healthy_gpus", {"rack": "rack1"}) == 3.0
        assert value("tpflex_rack_healthy_gpus", {"rack": "rack0"}) == 4.0
        assert value("tpflex_job_expected_throughput_ratio", {"job": "job1"}) == pytest.approx(
            plan.expected_throughput_ratio
        )
        assert value("tpflex_reconfigurations_total", {"job": "job1", "cause": "gpu_failed"}) == 1.0
        assert value("tpflex_reconfigurations_total", {"job": "job1", "cause": "drain"}) == 0.0
        boosted = {(c.gpu.node, c.gpu.index): c.cap_w for c in plan.power_caps}
        assert value("tpflex_gpu_power_cap_watts", {"node": "rack1-n01", "gpu": "0"}) == boosted[("rack1-n01", 0)]
    assert value("tpflex_controller_is_leader") == 0.0


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_exposition_passes_promtool_lint():
    registry = CollectorRegistry()
    m = ControllerMetrics(registry)
    m.job_seen("j", 2)
    m.plan_observed("j", 3, 0.97, [(0, 4), (1, 3)])
    m.power_observed("n0", [(0, 1100.0)])
    for phase in PHASES:
        m.phase(phase, 0.2)
    out = subprocess.run(["promtool", "check", "metrics"], input=generate_latest(registry),
                         capture_output=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
