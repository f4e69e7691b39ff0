"""The demo's local cluster: a real etcd, a `tpflex-controller` process and one simulated
`tpflex-agent` process per node, on fixed loopback ports (checked free up front).

With ``tls=True`` everything is secured as docs/deploy.md describes: development
certificates (deploy/certs/make-dev-certs.sh) in the workdir, etcd with client TLS,
client-certificate checks and user/password auth, mTLS between the controller and the
agents, TLS (mTLS) on the trainer plan stream, HTTPS REST with admin and read-only tokens,
HTTPS agent /metrics."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from tpflex_controller.devtools.etcd_server import EtcdCluster, EtcdMember
from tpflex_controller.devtools.secure_etcd import (
    SERVICE_PASSWORDS,
    CertSet,
    enable_etcd_auth,
    make_dev_certs,
    write_password_files,
)
from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.etcd import Etcd, EtcdTls
from tpflex_proto.tls import channel_credentials


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
    readonly_token: str = "demo-readonly-token"
    lease_ttl_s: int = 2
    tls: bool = False
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    etcd_server: EtcdCluster | None = None
    etcd: Etcd | None = None
    agent_addresses: dict[str, str] = field(default_factory=dict)

    @property
    def etcd_endpoint(self) -> str:
        return f"127.0.0.1:{self.ports.etcd_client}"

    @property
    def rest_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.ports.rest}"

    @property
    def certs(self) -> CertSet:
        return CertSet(self.workdir / "certs")

    @property
    def secrets(self) -> Path:
        return self.workdir / "secrets"

    @property
    def admin_token_file(self) -> Path:
        """The admin token's file (tpflex-run --register-token-file takes it)."""
        return self.workdir / "admin.tokens"

    @property
    def trainer_endpoint(self) -> str:
        return f"127.0.0.1:{self.ports.trainer}"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.tls:
            make_dev_certs(self.certs.directory)
            write_password_files(self.secrets)
        self._start_etcd()
        self.etcd = self._etcd_client()
        for rack in self.racks:
            self._write_rack(rack)
        tokens = self._token_file("admin.tokens", self.admin_token)
        readonly = self._token_file("readonly.tokens", self.readonly_token)
        self._spawn("controller", [
            _script("tpflex-controller"), "--name", "demo-controller", "--etcd", self.etcd_endpoint,
            "--rest-listen", f"127.0.0.1:{self.ports.rest}",
            "--trainer-listen", f"127.0.0.1:{self.ports.trainer}",
            "--admin-tokens-file", str(tokens), "--readonly-tokens-file", str(readonly),
            "--lease-ttl-s", "3", "--log-level", "WARNING",
        ], env={"TPFLEX_TIMEOUTS__AGENT_LEASE_TTL_S": str(self.lease_ttl_s),
                **self._controller_tls_env()})
        for i, rack in enumerate(self.racks):
            self._spawn(f"agent-{rack.node}", [
                _script("tpflex-agent"), "--backend", "sim", "--sim-gpus", str(rack.gpus),
                "--rack", rack.name, "--node", rack.node, "--etcd", self.etcd_endpoint,
                "--lease-ttl-s", str(self.lease_ttl_s),
                "--listen", f"127.0.0.1:{self.ports.agent_grpc(i)}",
                "--metrics-listen", f"127.0.0.1:{self.ports.agent_metrics(i)}",
                "--health-debounce-s", "0.2", "--log-level", "WARNING",
                *([] if self.tls else ["--insecure"]),  # plaintext only as an explicit choice
            ], env=self._agent_tls_env())
            self.agent_addresses[rack.node] = f"127.0.0.1:{self.ports.agent_grpc(i)}"
        self._wait_ready(timeout=60)

    def _start_etcd(self) -> None:
        server = EtcdCluster(1, self.workdir / "etcd")
        data = self.workdir / "etcd" / "demo.etcd"
        server.members = [EtcdMember("demo", data, self.ports.etcd_client, self.ports.etcd_peer,
                                     certs=self.certs if self.tls else None)]
        server.start()
        self.etcd_server = server
        if self.tls:
            enable_etcd_auth(self.etcd_endpoint, self.certs)

    def _etcd_client(self) -> Etcd:
        """The demo's own etcd client (the controller's identity when TLS is on)."""
        if not self.tls:
            return Etcd([self.etcd_endpoint], timeout=2.0)
        c = self.certs
        return Etcd([self.etcd_endpoint], timeout=2.0, user="tpflex-controller",
                    password=SERVICE_PASSWORDS["tpflex-controller"],
                    tls=EtcdTls(c.ca, c.cert("controller"), c.key("controller")))

    def _token_file(self, name: str, token: str) -> Path:
        path = self.workdir / name
        path.write_text(token + "\n")
        path.chmod(0o600)
        return path

    def _etcd_env(self, identity: str, user: str) -> dict[str, str]:
        c = self.certs
        return {"TPFLEX_ETCD__CA_FILE": c.ca, "TPFLEX_ETCD__CERT_FILE": c.cert(identity),
                "TPFLEX_ETCD__KEY_FILE": c.key(identity), "TPFLEX_ETCD__USERNAME": user,
                "TPFLEX_ETCD__PASSWORD_FILE": str(self.secrets / f"{user}.password")}

    def _controller_tls_env(self) -> dict[str, str]:
        if not self.tls:
            return {}
        c, me = self.certs, "controller"
        return {
            **self._etcd_env(me, "tpflex-controller"),
            "TPFLEX_REST__TLS_CERT_FILE": c.cert(me), "TPFLEX_REST__TLS_KEY_FILE": c.key(me),
            "TPFLEX_TRAINER__TLS_CERT_FILE": c.cert(me), "TPFLEX_TRAINER__TLS_KEY_FILE": c.key(me),
            "TPFLEX_TRAINER__CLIENT_CA_FILE": c.ca, "TPFLEX_TRAINER__CLIENT_NAMES": "tpflex-trainer",
            "TPFLEX_AGENTS__CA_FILE": c.ca, "TPFLEX_AGENTS__CERT_FILE": c.cert(me),
            "TPFLEX_AGENTS__KEY_FILE": c.key(me),
        }

    def _agent_tls_env(self) -> dict[str, str]:
        if not self.tls:
            return {}
        c, me = self.certs, "agent"
        return {
            **self._etcd_env(me, "tpflex-agent"),
            "TPFLEX_GRPC__TLS_CERT_FILE": c.cert(me), "TPFLEX_GRPC__TLS_KEY_FILE": c.key(me),
            "TPFLEX_GRPC__CLIENT_CA_FILE": c.ca,
            "TPFLEX_METRICS__TLS_CERT_FILE": c.cert(me), "TPFLEX_METRICS__TLS_KEY_FILE": c.key(me),
        }

    def trainer_env(self) -> dict[str, str]:
        """What every training rank needs to reach the plan stream (TLS with a client
        certificate when TLS is on)."""
        if not self.tls:
            return {}
        c = self.certs
        return {"TPFLEX_TLS_CA": c.ca, "TPFLEX_TLS_CERT": c.cert("trainer"),
                "TPFLEX_TLS_KEY": c.key("trainer")}

    def register_job(self, spec: types_pb2.JobSpec, name: str = "demo") -> dict[str, str]:
        """Register ``spec`` as an operator does (RegisterJob with the admin token) and
        return the ranks' environment for the credential issued: its file, which only
        this user can read (docs/launch.md, "Job credentials")."""
        from tpflex_trainer.hooks.control import ControlConfig
        from tpflex_trainer.launch.credential import register_for_credential

        tls = self.trainer_env()
        control = ControlConfig(endpoints=(self.trainer_endpoint,), job=spec.name, rank=0,
                                tls_ca_file=tls.get("TPFLEX_TLS_CA"), tls_cert_file=tls.get("TPFLEX_TLS_CERT"),
                                tls_key_file=tls.get("TPFLEX_TLS_KEY"))
        token = register_for_credential(control, spec, self.admin_token, name)
        if not token:  # the controller checks no credentials
            return {}
        path = self.workdir / f"{spec.name}.credential"
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(token + "\n")
        return {"TPFLEX_JOB_CREDENTIAL_FILE": str(path)}

    def ssl_context(self) -> ssl.SSLContext | None:
        """For HTTPS to the REST API and the agents' /metrics (None when TLS is off)."""
        return ssl.create_default_context(cafile=self.certs.ca) if self.tls else None

    def rest_headers(self, *, admin: bool = True) -> dict[str, str]:
        token = self.admin_token if admin else self.readonly_token
        return {"Authorization": f"Bearer {token}"}

    def agent_channel(self, node: str) -> grpc.Channel:
        """A channel to ``node``'s agent: mTLS with the controller's certificate when TLS is
        on (the agents accept only clients with a certificate of the demo's CA)."""
        address = self.agent_addresses[node]
        if not self.tls:
            return grpc.insecure_channel(address)
        c = self.certs
        creds = channel_credentials(c.ca, c.cert("controller"), c.key("controller"))
        return grpc.secure_channel(address, creds)

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
                    with urllib.request.urlopen(self.rest_url + "/readyz", timeout=1,
                                                context=self.ssl_context()) as r:
                        if r.status == 200:
                            return
                except OSError:
                    pass
            time.sleep(0.05)
        raise TimeoutError(f"demo cluster not ready within {timeout:.0f}s; logs in {self.workdir}")

    def dead_services(self) -> list[tuple[str, int]]:
        """(name, exit code) of every service process that has exited (reaped here, so no
        zombie stays behind), etcd included."""
        dead = [(name, proc.returncode) for name, proc in self.procs.items() if proc.poll() is not None]
        if self.etcd_server is not None:
            for m in self.etcd_server.members:
                if m.proc is not None and m.proc.poll() is not None:
                    dead.append((f"etcd-{m.name}", m.proc.returncode))
        return dead

    def log_of(self, name: str) -> Path:
        return self.workdir / ("etcd" if name.startswith("etcd-") else f"{name}.log")

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

