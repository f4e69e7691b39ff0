"""Development TLS material and a secured etcd: certificates from
``deploy/certs/make-dev-certs.sh``, etcd's client-TLS arguments, and etcd user/password
auth set up the way docs/deploy.md describes (root user, a ``tpflex`` role with read-write
on ``/tpflex/v1/``, one user per service).

Used by the security tests (tests/security/stack.py) and ``tpflex-demo --tls``.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from tpflex_proto.tls import channel_credentials

CERTS_SCRIPT = Path(__file__).resolve().parents[3] / "deploy" / "certs" / "make-dev-certs.sh"
ROOT_PASSWORD = "root-pw"
SERVICE_PASSWORDS = {"tpflex-controller": "controller-pw", "tpflex-agent": "agent-pw"}
TPFLEX_PREFIX = b"/tpflex/v1/"
RENDEZVOUS_PREFIX = b"/tpflex/rendezvous/v1/"  # the jobs' rendezvous stores (controller only)
LIVENESS_PREFIX = b"/tpflex/liveness/v1/"  # the jobs' restart epochs (controller only)
CREDENTIALS_PREFIX = b"/tpflex/credentials/v1/"  # the jobs' credential hashes (controller only)


class DevCertsError(RuntimeError):
    """The certificate script is missing or failed; the message carries its stderr."""


def make_dev_certs(out: Path, *, extra_sans: str = "", script: Path = CERTS_SCRIPT,
                   timeout_s: float = 60.0) -> Path:
    """Run the development-certificate script into ``out`` (idempotent); returns ``out``."""
    if not script.exists():
        raise DevCertsError(f"certificate script not found: {script} (run from a source checkout)")
    env = {"PATH": "/usr/bin:/bin", "TPFLEX_CERT_SANS": extra_sans}
    result = subprocess.run(["bash", str(script), str(out)], capture_output=True, text=True,
                            env=env, timeout=timeout_s)
    if result.returncode != 0:
        raise DevCertsError(f"{script.name} failed ({result.returncode}): {result.stderr.strip()}")
    return out


@dataclass(frozen=True)
class CertSet:
    """The files make-dev-certs.sh writes into ``directory``."""

    directory: Path

    @property
    def ca(self) -> str:
        return str(self.directory / "ca.pem")

    def cert(self, name: str) -> str:
        return str(self.directory / f"{name}.pem")

    def key(self, name: str) -> str:
        return str(self.directory / f"{name}-key.pem")


def etcd_tls_args(certs: CertSet) -> list[str]:
    """etcd flags: serve clients over TLS with etcd's certificate and require a client
    certificate signed by the development CA."""
    return ["--cert-file", certs.cert("etcd"), "--key-file", certs.key("etcd"),
            "--trusted-ca-file", certs.ca, "--client-cert-auth"]


def enable_etcd_auth(endpoint: str, certs: CertSet, *, root_password: str = ROOT_PASSWORD,
                     users: Mapping[str, str] = SERVICE_PASSWORDS, timeout_s: float = 5.0) -> None:
    """Root user, a ``tpflex`` role with read-write on /tpflex/v1/, ``users`` (name ->
    password) holding that role, a ``tpflex-rendezvous`` role with read-write on
    /tpflex/rendezvous/v1/, /tpflex/liveness/v1/ and /tpflex/credentials/v1/ for
    ``tpflex-controller``; then auth on
    (etcd's gRPC Auth API, as etcdctl would)."""
    from pyetcd import etcdrpc

    creds = channel_credentials(certs.ca, certs.cert("etcd"), certs.key("etcd"))
    with grpc.secure_channel(endpoint, creds) as ch:
        auth = etcdrpc.AuthStub(ch)
        auth.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password=root_password), timeout=timeout_s)
        auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=timeout_s)
        for role in ("tpflex", "tpflex-rendezvous"):
            auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name=role), timeout=timeout_s)
        for role, prefix in (("tpflex", TPFLEX_PREFIX), ("tpflex-rendezvous", RENDEZVOUS_PREFIX),
                             ("tpflex-rendezvous", LIVENESS_PREFIX),
                             ("tpflex-rendezvous", CREDENTIALS_PREFIX)):
            perm = etcdrpc.Permission(permType=etcdrpc.Permission.READWRITE, key=prefix,
                                      range_end=_prefix_end(prefix))
            auth.RoleGrantPermission(etcdrpc.AuthRoleGrantPermissionRequest(name=role, perm=perm),
                                     timeout=timeout_s)
        for user, password in users.items():
            auth.UserAdd(etcdrpc.AuthUserAddRequest(name=user, password=password), timeout=timeout_s)
            roles = ("tpflex", "tpflex-rendezvous") if user == "tpflex-controller" else ("tpflex",)
            for role in roles:
                auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user=user, role=role),
                                   timeout=timeout_s)
        auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=timeout_s)


def write_password_files(directory: Path, users: Mapping[str, str] = SERVICE_PASSWORDS) -> dict[str, Path]:
    """One ``<user>.password`` file (mode 0600) per user; returns user -> path."""
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for user, password in users.items():
        path = directory / f"{user}.password"
        path.write_text(password + "\n")
        path.chmod(0o600)
        out[user] = path
    return out


def _prefix_end(prefix: bytes) -> bytes:
    """The range end covering every key that starts with ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])
