"""A secured tpflex stack for tests: etcd with client TLS, client-certificate checks and
user/password auth, a real ``tpflex-controller`` (HTTPS REST with token files, TLS trainer
stream, mTLS to agents) and a real ``tpflex-agent`` (mTLS gRPC, HTTPS /metrics), all
configured through TOML files the way deploy/config/*.toml does it."""

from __future__ import annotations

import os
import re
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from tpflex_controller.devtools.secure_etcd import (
    ROOT_PASSWORD,
    SERVICE_PASSWORDS,
    CertSet,
    enable_etcd_auth,
    etcd_tls_args,
    write_password_files,
)
from tpflex_proto.etcd import Etcd, EtcdTls

from tests.support.etcd_server import ETCD_BIN
from tests.support.ports import free_ports
from tests.support.wait import wait_until  # noqa: F401  (re-exported)

BIN = Path(sys.executable).parent
ADMIN_TOKEN = "admin-" + "a" * 40
READ_TOKEN = "reader-" + "r" * 40
PASSWORDS = SERVICE_PASSWORDS
AGENT_READY = re.compile(r"tpflex-agent ready node=(\S+) backend=\S+ grpc=(\S+):(\d+) metrics=(\S+):(\d+)")




class Proc:
    """A child process whose stdout+stderr lines are collected by a thread."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("TPFLEX_")}
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**clean, **(env or {})}
        )
        self.lines: list[str] = []
        self._cv = threading.Condition()
        self._eof = False
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            with self._cv:
                self.lines.append(line)
                self._cv.notify_all()
        with self._cv:
            self._eof = True
            self._cv.notify_all()

    def output(self) -> str:
        with self._cv:
            return "".join(self.lines)

    def wait_line(self, pattern: re.Pattern | str, timeout: float = 30.0) -> re.Match:
        """The first output line matching ``pattern``, waiting for it."""
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for line in self.lines:
                    m = rx.search(line)
                    if m:
                        return m
                left = deadline - time.monotonic()
                if left <= 0 or self._eof:
                    raise AssertionError(f"no line matching {rx.pattern!r}; output:\n{''.join(self.lines)[-3000:]}")
                self._cv.wait(min(left, 0.5))

    def terminate(self) -> None:
        """SIGTERM, without waiting (``stop`` waits): several services then exit at once."""
        if self.proc.poll() is None:
            self.proc.terminate()

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def stop_all(procs: list[Proc]) -> None:
    """Stop services together: SIGTERM to all, then wait for each (their graceful exits
    overlap instead of adding up). etcd is stopped after them by the callers: a service
    leaving cleanly still writes to it."""
    for p in procs:
        p.terminate()
    for p in procs:
        p.stop()


# ---- etcd with TLS and auth ----


@dataclass
class SecureEtcd:
    certs: Path
    proc: Proc
    endpoint: str

    def client(self, cert: str | None = "controller", user: str | None = None,
               password: str | None = None) -> Etcd:
        tls = EtcdTls(
            str(self.certs / "ca.pem"),
            str(self.certs / f"{cert}.pem") if cert else None,
            str(self.certs / f"{cert}-key.pem") if cert else None,
        )
        return Etcd([self.endpoint], timeout=3.0, user=user, password=password, tls=tls)

    def enable_auth(self) -> None:
        """Root user, a role with read-write on /tpflex/v1/, the controller and agent users
        with passwords; then auth on (tpflex_controller.devtools.secure_etcd)."""
        enable_etcd_auth(self.endpoint, CertSet(self.certs), root_password=ROOT_PASSWORD,
                         users=PASSWORDS)

    def stop(self) -> None:
        self.proc.stop()


def start_secure_etcd(certs: Path, base: Path, *, auth_token_ttl_s: int = 300) -> SecureEtcd:
    """etcd serving clients over TLS only, requiring a certificate signed by the CA."""
    client_port, peer_port = free_ports(2)
    url = f"https://127.0.0.1:{client_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    proc = Proc([
        ETCD_BIN, "--name", "s0", "--data-dir", str(base / "s0.etcd"),
        "--listen-client-urls", url, "--advertise-client-urls", url,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"s0={peer}", "--initial-cluster-token", "tpflex-sec",
        *etcd_tls_args(CertSet(certs)),
        "--auth-token-ttl", str(auth_token_ttl_s),
        "--heartbeat-interval", "50", "--election-timeout", "500",
        "--log-level", "error", "--logger", "zap",
    ])
    etcd = SecureEtcd(certs, proc, f"127.0.0.1:{client_port}")
    probe = etcd.client()

    def ready() -> bool:
        assert proc.proc.poll() is None, f"etcd exited: {proc.output()[-2000:]}"
        try:
            probe.get("/probe")
            return True
        except Exception:
            return False

    try:
        wait_until(ready, 30, "etcd over TLS")
    finally:
        probe.close()
    return etcd


# ---- tpflex services configured by TOML files ----


def write_secrets(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "admin.tokens").write_text(f"# admins\n{ADMIN_TOKEN}\n")
    (directory / "readonly.tokens").write_text(f"{READ_TOKEN}\n")
    write_password_files(directory, PASSWORDS)
    return directory


def controller_toml(certs: Path, secrets: Path, etcd_endpoint: str, rest_port: int,
                    trainer_port: int, *, trainer_mtls: bool = False) -> str:
    c = certs
    client_ca = f'client_ca_file = "{c}/ca.pem"' if trainer_mtls else ""
    return f"""
[controller]
name = "ctl-sec"
log_level = "info"

[etcd]
endpoints = ["https://{etcd_endpoint}"]
lease_ttl_s = 2
username = "tpflex-controller"
password_file = "{secrets}/tpflex-controller.password"
ca_file = "{c}/ca.pem"
cert_file = "{c}/controller.pem"
key_file = "{c}/controller-key.pem"

[rest]
listen = "127.0.0.1:{rest_port}"
tls_cert_file = "{c}/controller.pem"
tls_key_file = "{c}/controller-key.pem"
admin_tokens_file = "{secrets}/admin.tokens"
readonly_tokens_file = "{secrets}/readonly.tokens"

[trainer]
listen = "127.0.0.1:{trainer_port}"
tls_cert_file = "{c}/controller.pem"
tls_key_file = "{c}/controller-key.pem"
{client_ca}

[agents]
ca_file = "{c}/ca.pem"
cert_file = "{c}/controller.pem"
key_file = "{c}/controller-key.pem"

[timeouts]
agent_lease_ttl_s = 2
reaction_bound_s = 10
trainer_collective_timeout_s = 600
"""


def agent_toml(certs: Path, secrets: Path, etcd_endpoint: str, node: str) -> str:
    c = certs
    return f"""
[agent]
node = "{node}"
rack = "rack-sec"
backend = "sim"
sim_gpus = 2

[etcd]
endpoints = ["https://{etcd_endpoint}"]
lease_ttl_s = 2
username = "tpflex-agent"
password_file = "{secrets}/tpflex-agent.password"
ca_file = "{c}/ca.pem"
cert_file = "{c}/agent.pem"
key_file = "{c}/agent-key.pem"

[grpc]
listen = "127.0.0.1:0"
tls_cert_file = "{c}/agent.pem"
tls_key_file = "{c}/agent-key.pem"
client_ca_file = "{c}/ca.pem"
client_names = ["tpflex-controller"]

[metrics]
listen = "127.0.0.1:0"
tls_cert_file = "{c}/agent.pem"
tls_key_file = "{c}/agent-key.pem"
"""


def controller_healthy(http: httpx.Client, controller: Proc) -> bool:
    assert controller.proc.poll() is None, f"controller exited: {controller.output()[-2000:]}"
    try:
        return http.get("/healthz").status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Stack:
    certs: Path
    etcd: SecureEtcd
    controller: Proc
    agent: Proc
    rest_port: int
    trainer_port: int
    agent_node: str
    agent_grpc: str
    agent_metrics_port: int
    base: Path
    extra: list = field(default_factory=list)

    @property
    def rest_url(self) -> str:
        return f"https://127.0.0.1:{self.rest_port}"

    def http(self) -> httpx.Client:
        ctx = ssl.create_default_context(cafile=str(self.certs / "ca.pem"))
        return httpx.Client(base_url=self.rest_url, verify=ctx, timeout=10)

    def start_agent(self, base: Path, node: str) -> tuple[Proc, str]:
        """Another agent with the same settings under another node name; (process, gRPC address)."""
        config = base / f"agent-{node}.toml"
        config.write_text(agent_toml(self.certs, base / "secrets", self.etcd.endpoint, node))
        agent = Proc([str(BIN / "tpflex-agent"), "--config", str(config)])
        self.extra.append(agent)
        m = agent.wait_line(AGENT_READY, 30)
        return agent, f"{m.group(2)}:{m.group(3)}"

    def stop(self) -> None:
        stop_all([*self.extra, self.agent, self.controller])
        self.etcd.stop()


def start_stack(certs: Path, base: Path) -> Stack:
    """etcd (TLS + auth), then the controller and one agent configured to use it."""
    etcd = start_secure_etcd(certs, base)
    procs: list[Proc] = []
    try:
        etcd.enable_auth()
        secrets = write_secrets(base / "secrets")
        rest_port, trainer_port = free_ports(2)
        (base / "controller.toml").write_text(
            controller_toml(certs, secrets, etcd.endpoint, rest_port, trainer_port))
        (base / "agent.toml").write_text(agent_toml(certs, secrets, etcd.endpoint, "sec-node-1"))
        controller = Proc([str(BIN / "tpflex-controller"), "--config", str(base / "controller.toml")])
        procs.append(controller)
        agent = Proc([str(BIN / "tpflex-agent"), "--config", str(base / "agent.toml")])
        procs.append(agent)
        m = agent.wait_line(AGENT_READY, 30)
        controller.wait_line(r"controller started", 30)
        stack = Stack(certs, etcd, controller, agent, rest_port, trainer_port, m.group(1),
                      f"{m.group(2)}:{m.group(3)}", int(m.group(5)), base)
        with stack.http() as http:
            wait_until(lambda: controller_healthy(http, controller), 30, "the controller's HTTPS /healthz")
        return stack
    except BaseException:
        for p in procs:
            p.stop()
        etcd.stop()
        raise
