"""Start a real etcd (Debian's etcd-server) on free loopback ports with its own data
directory, wait until it is healthy, stop it afterwards. Also a 3-member cluster.

Used by the pytest fixtures (tests/conftest.py), the benchmarks and `tpflex-demo`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tpflex_controller.devtools.ports import free_ports
from tpflex_controller.devtools.secure_etcd import CertSet, etcd_tls_args

ETCD_BIN = os.environ.get("TPFLEX_ETCD_BIN") or shutil.which("etcd") or "/usr/bin/etcd"


class EtcdMember:
    def __init__(self, name: str, data_dir: Path, client_port: int, peer_port: int,
                 *, certs: CertSet | None = None) -> None:
        self.name = name
        self.certs = certs  # serve clients over TLS with client-certificate checks
        self.data_dir = data_dir
        self.client_port = client_port
        self.peer_port = peer_port
        self.proc: subprocess.Popen | None = None
        self.log_path = data_dir.with_suffix(".log")

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{'https' if self.certs else 'http'}://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def start(self, initial_cluster: str, state: str = "new", extra: list[str] = ()) -> None:
        args = [
            ETCD_BIN,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", initial_cluster,
            "--initial-cluster-state", state,
            "--initial-cluster-token", "tpflex-test",
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
            "--quota-backend-bytes", str(2 << 30),
            "--log-level", "error",
            "--logger", "zap",
            *(etcd_tls_args(self.certs) if self.certs else []),
            *extra,
        ]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if getattr(self, "_log", None):
            self._log.close()
            self._log = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class EtcdCluster:
    """One or more etcd members on loopback; ``endpoints`` lists their client addresses."""

    def __init__(self, size: int = 1, base_dir: str | Path | None = None) -> None:
        self._own_dir = base_dir is None
        self.base_dir = Path(base_dir or tempfile.mkdtemp(prefix="tpflex-etcd-"))
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.members: list[EtcdMember] = []
        ports = free_ports(2 * size)
        for i in range(size):
            self.members.append(
                EtcdMember(f"m{i}", self.base_dir / f"m{i}.etcd", ports[2 * i], ports[2 * i + 1])
            )

    @property
    def initial_cluster(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        for m in self.members:
            m.start(self.initial_cluster)
        self.wait_healthy(timeout)
        return self

    def restart_member(self, i: int, timeout: float = 30.0) -> None:
        m = self.members[i]
        m.start(self.initial_cluster, state="existing")
        self._wait(lambda: _member_healthy(m), timeout, f"etcd member {m.name} not healthy")

    def wait_healthy(self, timeout: float = 30.0) -> None:
        live = [m for m in self.members if m.alive()]
        self._wait(lambda: all(_member_healthy(m) for m in live), timeout, "etcd not healthy")

    def _wait(self, cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in self.members:
                if m.proc is not None and m.proc.poll() is not None:
                    raise RuntimeError(f"{what}: {m.name} exited; log: {_tail(m.log_path)}")
            if cond():
                return
            time.sleep(0.05)
        raise TimeoutError(f"{what} within {timeout}s; log: {_tail(self.members[0].log_path)}")

    def stop(self) -> None:
        for m in self.members:
            m.stop()
        if self._own_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _member_healthy(m: EtcdMember) -> bool:
    """Healthy = the member answers a linearizable read (so it has a leader)."""
    import ssl
    import urllib.request

    ctx = None
    if m.certs is not None:
        ctx = ssl.create_default_context(cafile=m.certs.ca)
        ctx.load_cert_chain(m.certs.cert("etcd"), m.certs.key("etcd"))
    try:
        with urllib.request.urlopen(f"{m.client_url}/health", timeout=0.5, context=ctx) as r:
            return b'"health":"true"' in r.read()
    except OSError:
        return False


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return "<no log>"
