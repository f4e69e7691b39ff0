"""A real Prometheus (Debian's package) scrapes a running controller and agent over HTTPS
with its client certificate, using deploy/prometheus/prometheus.yml with only the targets
and intervals rewritten; tpflex_ series are then queried through Prometheus' HTTP API.

With a job on the agent's rack (its ranks acking, reporting steps, one GPU drained), every
metric name that alerts.yml and the Grafana dashboard use is exported, and the shipped
TpflexPlanNotAcked rule evaluates true while a rank withholds its ack (false once it acks);
TpflexRackDegradedTooLong's expression returns the rack with the drained GPU."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
from tpflex_agent.sim import SimGpuSpec
from tpflex_controller import synthetic
from tpflex_controller.credentials import Credentials
from tpflex_proto import codec, controller_pb2, controller_pb2_grpc, keys, types_pb2
from tpflex_proto.tls import channel_credentials

from tests.deploy.promql import rule_exprs
from tests.deploy.tools import (
    DEPLOY,
    assert_used_metrics_exported,
    prom_query,
    require_tool,
)
from tests.security.stack import (
    ADMIN_TOKEN,
    AGENT_READY,
    BIN,
    PASSWORDS,
    Proc,
    Stack,
    agent_toml,
    start_stack,
    wait_until,
)
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
    text = _rewrite(text, "evaluation_interval: 30s", "evaluation_interval: 1s")
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


_query = prom_query


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


JOB = "job-live"


def _alert_expr(name: str) -> str:
    """The expression of alert ``name`` in the shipped alerts.yml."""
    text = (PROM / "alerts.yml").read_text()
    names = re.findall(r"^\s*- alert: (\w+)", text, re.M)
    exprs = rule_exprs(text)
    assert len(names) == len(exprs) and name in names
    return exprs[names.index(name)]



def _pending(url: str, alert: str, job: str) -> bool:
    r = httpx.get(f"{url}/api/v1/alerts", timeout=2)
    return any(a["labels"].get("alertname") == alert and a["labels"].get("training_job") == job
               and a["state"] in ("pending", "firing") for a in r.json()["data"]["alerts"])


def test_every_metric_the_alerts_and_dashboard_use_is_exported_and_a_withheld_ack_fires(live):
    url, stack, proc = live
    # the sim GPUs' limits (the agent's own series, as Prometheus scraped them)
    max_w = wait_until(lambda: _query(url, "max(tpflex_gpu_power_max_limit_watts)", proc), 30,
                       "the agent's max power limit")
    tdp, low, high = SimGpuSpec().tdp_w, SimGpuSpec().min_limit_w, float(max_w[0]["value"][1])
    etcd = stack.etcd.client(cert="controller", user="tpflex-controller", password=PASSWORDS["tpflex-controller"])
    try:
        rack = types_pb2.Rack(name="rack-sec", domain_size=2, power_budget_w=2 * high, gpu_tdp_w=tdp,
                              gpu_min_w=low, gpu_max_w=high, nodes=[stack.agent_node], gpus_per_node=2)
        etcd.put(keys.rack("rack-sec"), codec.encode(rack))
        etcd.put(keys.job_spec(JOB), codec.encode(synthetic.job(JOB, ["rack-sec"], 2)))
        credential = Credentials(etcd).issue(JOB, "test", "test")  # as registering issues one
    finally:
        etcd.close()
    not_acked = _alert_expr("TpflexPlanNotAcked")
    firing = lambda: _query(url, not_acked, proc)  # noqa: E731
    channel = grpc.secure_channel(f"localhost:{stack.trainer_port}",
                                  channel_credentials(str(stack.certs / "ca.pem")))
    try:
        trainer = controller_pb2_grpc.TrainerStub(channel)
        job_credential = (("authorization", f"Bearer {credential}"),)  # the trainer plane requires one
        wait_until(lambda: _query(url, f'tpflex_plan_generation{{training_job="{JOB}"}} == 1', proc), 30,
                   "generation 1 of the job in Prometheus")
        # rank 0 acks generation 1, rank 1 withholds its ack: the alert's expression has data
        trainer.AckPlan(types_pb2.Ack(job=JOB, rank=0, generation=1), timeout=5, metadata=job_credential)
        for step in (1, 2, 3):  # two steps at the base degree: a measured goodput ratio
            trainer.ReportStep(controller_pb2.StepReport(
                job=JOB, rank=0, replica=0, step=step, generation=1, step_seconds=0.01, samples=8,
                tp_degree=2, base_tp=2), timeout=5, metadata=job_credential)
        result = wait_until(firing, 30, f"{not_acked!r} returning data while rank 1 withholds its ack")
        assert [(r["metric"]["training_job"], r["value"][1]) for r in result] == [(JOB, "1")]
        acked = _query(url, f'tpflex_plan_acked_generation{{training_job="{JOB}"}}', proc)
        assert [r["value"][1] for r in acked] == ["0"]
        # the shipped rule, loaded by Prometheus from alerts.yml, evaluates true (pending: for 5m)
        wait_until(lambda: _pending(url, "TpflexPlanNotAcked", JOB), 30, "TpflexPlanNotAcked pending")
        # a drained GPU: generation 2 boosts the other one (a power plan: cap series)
        with stack.http() as http:
            r = http.post(f"/v1/nodes/{stack.agent_node}/gpus/1/drain", json={"reason": "live metrics"},
                          headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
            assert r.status_code == 202, r.text
        wait_until(lambda: _query(url, f'tpflex_plan_generation{{training_job="{JOB}"}} == 2', proc), 30,
                   "generation 2 of the job in Prometheus")
        # the other alert that could never fire before: the drained GPU degrades rack-sec
        degraded = _alert_expr("TpflexRackDegradedTooLong")
        result = wait_until(lambda: _query(url, degraded, proc), 30, f"{degraded!r} returning the drained rack")
        assert [(r["metric"]["rack"], r["value"][1]) for r in result] == [("rack-sec", "1")]
        assert_used_metrics_exported(url, proc, 30)
        # the one rank of generation 2 acks it: the expression is empty again
        trainer.AckPlan(types_pb2.Ack(job=JOB, rank=0, generation=2), timeout=5, metadata=job_credential)
        wait_until(lambda: _query(url, f'tpflex_plan_acked_generation{{training_job="{JOB}"}} == 2', proc), 30,
                   "acked generation 2 in Prometheus")
        assert firing() == []
    finally:
        channel.close()


def _probe(stack: Stack, addr: str) -> subprocess.CompletedProcess:
    """deploy/docker/grpc-health-probe.py as the agent pod's readiness probe runs it
    (30-agent.yaml), with the agent's certificate."""
    c = stack.certs
    return subprocess.run(
        [sys.executable, str(DEPLOY / "docker" / "grpc-health-probe.py"), f"--addr={addr}",
         f"--ca={c / 'ca.pem'}", f"--cert={c / 'agent.pem'}", f"--key={c / 'agent-key.pem'}",
         "--server-name=tpflex-agent", "--service=tpflex.v1.Agent", "--timeout=3"],
        capture_output=True, text=True, timeout=30)


def test_the_agent_pods_readiness_probe_checks_grpc_health_over_mtls(live):
    """The exec readiness probe of deploy/kubernetes/30-agent.yaml against real agents: an
    agent that accepts the CN tpflex-agent (as that ConfigMap does) answers SERVING (exit
    0); one that accepts only the controller refuses it (exit 1, PERMISSION_DENIED); a
    stopped agent is not ready (exit 1)."""
    _, stack, _ = live
    config = stack.base / "agent-probe.toml"
    text = agent_toml(stack.certs, stack.base / "secrets", stack.etcd.endpoint, "probe-node")
    config.write_text(text.replace('client_names = ["tpflex-controller"]',
                                   'client_names = ["tpflex-controller", "tpflex-agent"]', 1))
    assert "tpflex-agent\"]" in config.read_text()
    agent = Proc([str(BIN / "tpflex-agent"), "--config", str(config)])
    try:
        m = agent.wait_line(AGENT_READY, 30)
        addr = f"127.0.0.1:{m.group(3)}"
        ready = _probe(stack, addr)
        assert ready.returncode == 0 and "SERVING" in ready.stdout, ready.stdout + ready.stderr
        refused = _probe(stack, f"127.0.0.1:{stack.agent_grpc.rsplit(':', 1)[1]}")
        assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr, refused.stdout + refused.stderr
    finally:
        agent.stop()
    gone = _probe(stack, addr)
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr, gone.stdout + gone.stderr
