"""The demo's local cluster: a real etcd, a `tpflex-controller` process and one simulated
`tpflex-agent` process per node, on fixed loopback ports (checked free up front)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.devtools.etcd_server import EtcdCluster, EtcdMember
from tpflex_proto.etcd import Etcd


class PortsTaken(RuntimeError):
    """Some of the demo's ports are in use; the message lists them."""


@dataclass(frozen=True)
class DemoPorts:
    base: int = 27400

    @property
    def etcd_client(self) -> int:
        return self.base

    @property
    def etcd_peer(self) -> int:
        return self.base + 1

    @property
    def rest(self) -> int:
        return self.base + 2

    @property
    def trainer(self) -> int:
        return self.base + 3

    @property
    def store(self) -> int:
        return self.base + 4

    def agent_grpc(self, i: int) -> int:
        return self.base + 10 + 2 * i

    def agent_metrics(self, i: int) -> int:
        return self.base + 11 + 2 * i

    def all(self, n_agents: int) -> list[int]:
        ports = [self.etcd_client, self.etcd_peer, self.rest, self.trainer, self.store]
        return ports + [p for i in range(n_agents) for p in (self.agent_grpc(i), self.agent_metrics(i))]


def check_ports_free(ports: list[int]) -> None:
    taken = []
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # as servers do: a port with only TIME_WAIT leftovers is free to listen on
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                taken.append(port)
    if taken:
        raise PortsTaken(
            f"ports already in use on 127.0.0.1: {', '.join(map(str, taken))} "
            f"(another demo running? pick others with --base-port)"
        )


@dataclass(frozen=True)
class RackLayout:
    name: str
    node: str
    gpus: int


@dataclass
class DemoCluster:
    ports: DemoPorts
    racks: tuple[RackLayout, ...]
    workdir: Path
    admin_token: str = "demo-admin-token"
    lease_ttl_s: int = 2
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    etcd_server: EtcdCluster | None = None
    etcd: Etcd | None = None
    agent_addresses: dict[str, str] = field(default_factory=dict)

    @property
    def etcd_endpoint(self) -> str:
        return f"127.0.0.1:{self.ports.etcd_client}"

    @property
    def rest_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.rest}"

    @property
    def trainer_endpoint(self) -> str:
        return f"127.0.0.1:{self.ports.trainer}"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._start_etcd()
        self.etcd = Etcd([self.etcd_endpoint], timeout=2.0)
        for rack in self.racks:
            self._write_rack(rack)
        tokens = self.workdir / "admin.tokens"
        tokens.write_text(self.admin_token + "\n")
        tokens.chmod(0o600)
        self._spawn("controller", [
            _script("tpflex-controller"), "--name", "demo-controller", "--etcd", self.etcd_endpoint,
            "--rest-listen", f"127.0.0.1:{self.ports.rest}",
            "--trainer-listen", f"127.0.0.1:{self.ports.trainer}",
            "--admin-tokens-file", str(tokens), "--lease-ttl-s", "3", "--log-level", "WARNING",
        ], env={"TPFLEX_TIMEOUTS__AGENT_LEASE_TTL_S": str(self.lease_ttl_s)})
        for i, rack in enumerate(self.racks):
            self._spawn(f"agent-{rack.node}", [
                _script("tpflex-agent"), "--backend", "sim", "--sim-gpus", str(rack.gpus),
                "--rack", rack.name, "--node", rack.node, "--etcd", self.etcd_endpoint,
                "--lease-ttl-s", str(self.lease_ttl_s),
                "--listen", f"127.0.0.1:{self.ports.agent_grpc(i)}",
                "--metrics-listen", f"127.0.0.1:{self.ports.agent_metrics(i)}",
                "--health-debounce-s", "0.2", "--log-level", "WARNING",
            ])
            self.agent_addresses[rack.node] = f"127.0.0.1:{self.ports.agent_grpc(i)}"
        self._wait_ready(timeout=60)

    def _start_etcd(self) -> None:
        server = EtcdCluster(1, self.workdir / "etcd")
        data = self.workdir / "etcd" / "demo.etcd"
        server.members = [EtcdMember("demo", data, self.ports.etcd_client, self.ports.etcd_peer)]
        server.start()
        self.etcd_server = server

    def _write_rack(self, rack: RackLayout) -> None:
        tdp = 700.0
        msg = types_pb2.Rack(
            name=rack.name, domain_size=rack.gpus, power_budget_w=rack.gpus * tdp * 1.3,
            gpu_tdp_w=tdp, gpu_min_w=200.0, gpu_max_w=tdp * 1.3, nodes=[rack.node],
            gpus_per_node=rack.gpus,
        )
        self.etcd.put(keys.rack(rack.name), codec.encode(msg))

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.workdir / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def _wait_ready(self, timeout: float) -> None:
        """Ready = a leader in etcd, every node registered, the REST API answering."""
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            leader = self.etcd.get(keys.LEADER)
            nodes, _ = self.etcd.get_prefix(keys.NODES)
            if leader is not None and len(nodes) == len(self.racks):
                try:
                    with urllib.request.urlopen(self.rest_url + "/readyz", timeout=1) as r:
                        if r.status == 200:
                            return
                except OSError:
                    pass
            time.sleep(0.05)
        raise TimeoutError(f"demo cluster not ready within {timeout:.0f}s; logs in {self.workdir}")

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.workdir / f"{name}.log").read_bytes()[-1500:].decode(errors="replace")
                raise RuntimeError(f"{name} exited with code {proc.returncode}:\n{tail}")

    def stop(self) -> None:
        stop_process_groups(self.procs.values())
        self.procs.clear()
        if self.etcd is not None:
            self.etcd.close()
            self.etcd = None
        if self.etcd_server is not None:
            self.etcd_server.stop()
            self.etcd_server = None


def stop_process_groups(procs, timeout_s: float = 10.0) -> None:
    """SIGTERM each process's group (started with start_new_session), SIGKILL stragglers."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _script(name: str) -> str:
    """A console script of this environment (the demo runs from the dev venv)."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def new_workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="tpflex-demo-"))

