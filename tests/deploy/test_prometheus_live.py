"""A real Prometheus (Debian's package) scrapes a running controller and agent over HTTPS
with its client certificate, using deploy/prometheus/prometheus.yml with only the targets
and intervals rewritten; tpflex_ series are then queried through Prometheus' HTTP API."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from tests.deploy.tools import DEPLOY, require_tool
from tests.security.stack import Proc, Stack, start_stack, wait_until
from tests.support.ports import free_port

PROM = DEPLOY / "prometheus"


def _rewrite(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"deploy/prometheus/prometheus.yml no longer has {old!r}"
    return text.replace(old, new)


def _stage(dest: Path, certs: Path, stack: Stack) -> Path:
    (dest / "tpflex" / "agents").mkdir(parents=True)
    (dest / "tpflex" / "tls").mkdir()
    shutil.copy(PROM / "alerts.yml", dest / "tpflex" / "alerts.yml")
    for name in ("ca.pem", "prometheus.pem", "prometheus-key.pem"):
        shutil.copy(certs / name, dest / "tpflex" / "tls" / name)
    text = (PROM / "prometheus.yml").read_text()
    text = _rewrite(text, "scrape_interval: 15s", "scrape_interval: 1s")
    text = _rewrite(text, "scrape_timeout: 10s", "scrape_timeout: 1s")
    text = _rewrite(text, '["ctl1.example.org:8470", "ctl2.example.org:8470"]', f'["127.0.0.1:{stack.rest_port}"]')
    text = _rewrite(text, '["10.0.0.11:2379", "10.0.0.12:2379", "10.0.0.13:2379"]', f'["{stack.etcd.endpoint}"]')
    (dest / "prometheus.yml").write_text(text)
    (dest / "tpflex" / "agents" / "test.yml").write_text(
        f'- targets: ["127.0.0.1:{stack.agent_metrics_port}"]\n  labels:\n    rack: rack-sec\n'
    )
    return dest / "prometheus.yml"


@pytest.fixture(scope="module")
def live(tmp_path_factory, dev_certs):
    prometheus = require_tool("prometheus", "/usr/bin/prometheus")
    base = tmp_path_factory.mktemp("prom-live")
    stack = start_stack(dev_certs, base / "stack")
    port = free_port()
    proc = None
    try:
        config = _stage(base / "etc-prometheus", dev_certs, stack)
        proc = Proc([
            prometheus, f"--config.file={config}", f"--storage.tsdb.path={base / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
        ])
        yield f"http://127.0.0.1:{port}", stack, proc
    finally:
        if proc is not None:
            proc.stop()
        stack.stop()


def _query(url: str, expr: str, proc: Proc) -> list[dict]:
    assert proc.proc.poll() is None, f"prometheus exited: {proc.output()[-2000:]}"
    try:
        r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=2)
    except httpx.HTTPError:
        return []  # not listening yet
    if r.status_code == 503:
        return []  # listening, still starting up ("Service Unavailable", not JSON)
    body = r.json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_prometheus_scrapes_controller_and_agent_over_https(live):
    url, stack, proc = live
    leader = wait_until(lambda: _query(url, "tpflex_controller_is_leader", proc), 30,
                        f"tpflex_controller_is_leader in Prometheus; log: {proc.output()[-1500:]}")
    assert leader[0]["metric"]["job"] == "tpflex-controller" and leader[0]["value"][1] == "1"
    limits = wait_until(lambda: _query(url, "tpflex_gpu_power_limit_watts", proc), 30,
                        "the agent's tpflex_gpu_power_limit_watts in Prometheus")
    assert {s["metric"]["node"] for s in limits} == {stack.agent_node}
    assert {s["metric"]["gpu"] for s in limits} == {"0", "1"}
    assert all(s["metric"]["job"] == "tpflex-agent" and s["metric"]["rack"] == "rack-sec" for s in limits)
    assert all(float(s["value"][1]) > 0 for s in limits)
    up = wait_until(lambda: _query(url, 'up{job=~"tpflex-.*|etcd"} == 1', proc), 30, "every target up")
    wait_until(lambda: len(_query(url, 'up{job=~"tpflex-.*|etcd"} == 1', proc)) == 3, 30,
               f"3 targets up, have {up}")
