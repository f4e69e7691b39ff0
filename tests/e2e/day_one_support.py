"""Helpers of tests/e2e/test_day_one.py: a cluster set up as docs/deploy.md's "Day one"
walkthrough does it, with real processes only. etcd with TLS and auth, two
``tpflex-controller`` and two ``tpflex-agent`` processes (NVML backend over the test
suite's fake libnvidia-ml) configured by TOML files, a real Prometheus with the shipped
prometheus.yml and alerts.yml, and ``tpflexctl`` run as its console script. Nothing here
writes to etcd: the operator's steps go through ``tpflexctl`` and the REST API."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.agent.support import FakeNvml, build_fake_nvml
from tests.deploy.tools import DEPLOY, prom_query
from tests.security.stack import (
    AGENT_READY,
    BIN,
    READ_TOKEN,
    Proc,
    SecureEtcd,
    agent_toml,
    controller_healthy,
    controller_toml,
    stop_all,
)
from tests.support.ports import free_ports
from tests.support.wait import wait_until

TPFLEXCTL = str(BIN / "tpflexctl")
RUN = str(BIN / "tpflex-run")
PROM = DEPLOY / "prometheus"


def _swap(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"expected one {old!r} in the stack's TOML"
    return text.replace(old, new)


def nvml_agent_toml(certs: Path, secrets: Path, etcd_endpoint: str, node: str, rack: str) -> str:
    """The secured stack's agent configuration on the NVML backend, in rack ``rack``."""
    text = agent_toml(certs, secrets, etcd_endpoint, node)
    text = _swap(text, 'rack = "rack-sec"', f'rack = "{rack}"')
    text = _swap(text, 'backend = "sim"\nsim_gpus = 2', 'backend = "nvml"')
    return text + "\n[health]\npoll_s = 0.1\ndebounce_s = 0.2\n"


def fake_gpus(path: Path, gpus: int, max_mw: int) -> FakeNvml:
    """A node's GPUs in the fake library's state file: default limit 700 W, max ``max_mw``."""
    build_fake_nvml()
    fake = FakeNvml(path, count=gpus)
    for i in range(gpus):
        fake.gpus[i].update(uuid=f"GPU-{path.stem}-{i:04d}", limit_mw=700_000, default_mw=700_000,
                            min_mw=200_000, max_mw=max_mw)
    return fake.write()


@dataclass
class Controller:
    proc: Proc
    rest_port: int
    trainer_port: int

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.rest_port}"


@dataclass
class Agent:
    proc: Proc
    node: str
    rack: str
    metrics_port: int
    fake: FakeNvml


@dataclass
class Cluster:
    certs: Path
    base: Path
    etcd: SecureEtcd
    controllers: list[Controller] = field(default_factory=list)
    agents: list[Agent] = field(default_factory=list)
    others: list[Proc] = field(default_factory=list)

    def start_controller(self, name: str) -> Controller:
        rest_port, trainer_port = free_ports(2)
        text = controller_toml(self.certs, self.base / "secrets", self.etcd.endpoint, rest_port, trainer_port)
        config = self.base / f"{name}.toml"
        config.write_text(_swap(text, 'name = "ctl-sec"', f'name = "{name}"'))
        ctl = Controller(Proc([str(BIN / "tpflex-controller"), "--config", str(config)]), rest_port, trainer_port)
        self.controllers.append(ctl)
        ctl.proc.wait_line(r"controller started", 30)
        with self.http(ctl) as http:
            wait_until(lambda: controller_healthy(http, ctl.proc), 30, f"{name}'s HTTPS /healthz")
        return ctl

    def start_agent(self, node: str, rack: str, gpus: int, max_mw: int) -> Agent:
        fake = fake_gpus(self.base / f"{node}.state", gpus, max_mw)
        config = self.base / f"agent-{node}.toml"
        config.write_text(nvml_agent_toml(self.certs, self.base / "secrets", self.etcd.endpoint, node, rack))
        proc = Proc([str(BIN / "tpflex-agent"), "--config", str(config)],
                    env=fake.env(self.base / f"{node}.nvml.log"))
        m = proc.wait_line(AGENT_READY, 30)
        assert m.group(1) == node and "backend=nvml" in m.group(0), m.group(0)
        agent = Agent(proc, node, rack, int(m.group(5)), fake)
        self.agents.append(agent)
        return agent

    def http(self, ctl: Controller | None = None) -> httpx.Client:
        ctx = ssl.create_default_context(cafile=str(self.certs / "ca.pem"))
        return httpx.Client(base_url=(ctl or self.controllers[0]).url, verify=ctx, timeout=10,
                            headers={"Authorization": f"Bearer {READ_TOKEN}"})

    @property
    def trainer_endpoints(self) -> str:
        return ",".join(f"127.0.0.1:{c.trainer_port}" for c in self.controllers)

    def tpflexctl(self, *args: str, admin: bool = False, timeout: float = 60) -> subprocess.CompletedProcess:
        """``tpflexctl`` against the first controller over HTTPS, with the read-only or the
        admin token file the controller reads."""
        tokens = self.base / "secrets" / ("admin.tokens" if admin else "readonly.tokens")
        return subprocess.run(
            [TPFLEXCTL, "--url", self.controllers[0].url, "--cacert", str(self.certs / "ca.pem"),
             "--token-file", str(tokens), *args],
            check=False, capture_output=True, text=True, timeout=timeout)

    def stop(self) -> None:
        stop_all([*self.others, *(a.proc for a in self.agents), *(c.proc for c in self.controllers)])
        self.etcd.stop()



# ---- Prometheus with the shipped configuration ----


def _rewrite(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"deploy/prometheus/prometheus.yml no longer has {old!r}"
    return text.replace(old, new)


def stage_prometheus(dest: Path, cluster: Cluster) -> Path:
    """/etc/prometheus as docs/deploy.md section 6 lays it out (alerts.yml, TLS files, one
    file_sd file per rack), the shipped prometheus.yml with only targets and intervals
    rewritten."""
    (dest / "tpflex" / "agents").mkdir(parents=True)
    (dest / "tpflex" / "tls").mkdir()
    shutil.copy(PROM / "alerts.yml", dest / "tpflex" / "alerts.yml")
    for name in ("ca.pem", "prometheus.pem", "prometheus-key.pem"):
        shutil.copy(cluster.certs / name, dest / "tpflex" / "tls" / name)
    text = (PROM / "prometheus.yml").read_text()
    text = _rewrite(text, "scrape_interval: 15s", "scrape_interval: 1s")
    text = _rewrite(text, "scrape_timeout: 10s", "scrape_timeout: 1s")
    text = _rewrite(text, "evaluation_interval: 30s", "evaluation_interval: 1s")
    text = _rewrite(text, "refresh_interval: 1m", "refresh_interval: 1s")
    controllers = ", ".join(f'"127.0.0.1:{c.rest_port}"' for c in cluster.controllers)
    text = _rewrite(text, '["ctl1.example.org:8470", "ctl2.example.org:8470"]', f"[{controllers}]")
    text = _rewrite(text, '["10.0.0.11:2379", "10.0.0.12:2379", "10.0.0.13:2379"]',
                    f'["{cluster.etcd.endpoint}"]')
    (dest / "prometheus.yml").write_text(text)
    for a in cluster.agents:
        (dest / "tpflex" / "agents" / f"{a.rack}.yml").write_text(
            f'- targets: ["127.0.0.1:{a.metrics_port}"]\n  labels:\n    rack: {a.rack}\n')
    return dest / "prometheus.yml"


query = prom_query
