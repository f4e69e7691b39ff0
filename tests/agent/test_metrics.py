"""/metrics over real HTTP, read at scrape time."""

from __future__ import annotations

import socket
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from tpflex_agent.metrics import start_metrics_server
from tpflex_agent.settings import MetricsSection


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text) for s in fam.samples
    }


def value(samples, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_scrape_reflects_the_devices_now(agent):
    httpd, port = start_metrics_server(agent.core, MetricsSection(listen="127.0.0.1:0"))
    try:
        g1 = dict(node="n1", gpu="1", UUID="GPU-sim-n1-0001", Hostname=socket.gethostname())
        s = scrape(port)
        assert value(s, "tpflex_gpu_power_limit_watts", **g1) == 700.0
        assert value(s, "tpflex_gpu_health_state", state="healthy", **g1) == 1.0
        assert value(s, "tpflex_gpu_xid_errors_total", **g1) == 0.0
        assert value(s, "tpflex_gpu_throttle_active", reason="sw_power_cap", **g1) == 1.0
        assert value(s, "tpflex_gpu_throttle_active", reason="hw_thermal", **g1) == 0.0
        assert value(s, "tpflex_agent_power_plan_generation") == 0.0

        agent.core.power.apply(9, [])
        agent.backend.set_power_limit(1, 850.0)  # read at scrape time, not cached
        agent.core.inject_fault(2, "xid79", 0.0)
        agent.core.inject_fault(0, "thermal", 0.0)
        s = scrape(port)
        assert value(s, "tpflex_gpu_power_limit_watts", **g1) == 850.0
        assert value(s, "tpflex_gpu_sm_clock_hertz", **g1) > 1.7e9
        g2 = dict(node="n1", gpu="2", UUID="GPU-sim-n1-0002", Hostname=socket.gethostname())
        assert value(s, "tpflex_gpu_health_state", state="failed", **g2) == 1.0
        assert value(s, "tpflex_gpu_health_state", state="healthy", **g2) == 0.0
        assert value(s, "tpflex_gpu_xid_errors_total", **g2) == 1.0
        assert value(s, "tpflex_gpu_readable", **g2) == 0.0
        assert ("tpflex_gpu_power_draw_watts", tuple(sorted(g2.items()))) not in s
        g0 = dict(node="n1", gpu="0", UUID="GPU-sim-n1-0000", Hostname=socket.gethostname())
        assert value(s, "tpflex_gpu_throttle_active", reason="hw_thermal", **g0) == 1.0
        assert value(s, "tpflex_gpu_temperature_celsius", **g0) >= 90
        assert value(s, "tpflex_agent_power_plan_generation") == 9.0
    finally:
        httpd.shutdown()
        httpd.server_close()
