"""deploy/env/etcd.env starts a real 3-member etcd cluster with TLS for clients and peers.

The file is written for three hosts (10.0.0.11-13). As docs/deploy.md tells an operator,
each member gets its own ETCD_NAME and its own address in the *_URLS lines; here, in
addition, every host:port becomes a free loopback port and /etc/tpflex/tls a temp dir
with the development certificates. Every other variable is used as written, and etcd
must not report any of them as unrecognized.
"""

from __future__ import annotations

import base64
import json
import re
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.deploy.tools import DEPLOY, make_certs, require_tool
from tests.support.ports import free_ports

ETCD_ENV = DEPLOY / "env" / "etcd.env"
MEMBER_URL_KEYS = (
    "ETCD_LISTEN_PEER_URLS",
    "ETCD_INITIAL_ADVERTISE_PEER_URLS",
    "ETCD_LISTEN_CLIENT_URLS",
    "ETCD_ADVERTISE_CLIENT_URLS",
)
URL = re.compile(r"(https?)://([\w.-]+):(\d+)")


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    return env


def member_envs(template: dict[str, str], certs: Path, data_root: Path) -> list[dict[str, str]]:
    """One environment per member of ETCD_INITIAL_CLUSTER, relocated to loopback."""
    members = dict(m.split("=", 1) for m in template["ETCD_INITIAL_CLUSTER"].split(","))
    own_host = URL.match(members[template["ETCD_NAME"]]).group(2)
    member_ports = {m.group(3) for key in MEMBER_URL_KEYS for m in URL.finditer(template[key])}
    hosts = [URL.match(url).group(2) for url in members.values()]
    endpoints = sorted((host, port) for host in hosts for port in member_ports)
    ports = dict(zip(endpoints, free_ports(len(endpoints)), strict=True))

    def relocate(value: str) -> str:
        value = URL.sub(lambda m: f"{m.group(1)}://127.0.0.1:{ports[(m.group(2), m.group(3))]}", value)
        return value.replace("/etc/tpflex/tls/", f"{certs}/")

    envs = []
    for name, peer_url in members.items():
        host = URL.match(peer_url).group(2)
        env = dict(template, ETCD_NAME=name, ETCD_DATA_DIR=str(data_root / name))
        for key in MEMBER_URL_KEYS:
            env[key] = env[key].replace(own_host, host)
        envs.append({k: relocate(v) for k, v in env.items()})
    return envs


def https_json(url: str, context: ssl.SSLContext, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    with urllib.request.urlopen(url, data=data, context=context, timeout=2) as r:
        return json.loads(r.read())


def client_context(certs: Path, name: str | None = "controller") -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    if name:
        context.load_cert_chain(certs / f"{name}.pem", certs / f"{name}-key.pem")
    return context


def wait_healthy(urls: list[str], context: ssl.SSLContext, procs, logs, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    pending = list(urls)
    while pending and time.monotonic() < deadline:
        for proc, log in zip(procs, logs, strict=True):
            assert proc.poll() is None, f"etcd exited: {log.read_text()[-2000:]}"
        try:
            if https_json(f"{pending[0]}/health", context).get("health") == "true":
                pending.pop(0)
                continue
        except OSError:
            pass
        time.sleep(0.1)
    assert not pending, f"not healthy: {pending}; log: {logs[0].read_text()[-2000:]}"


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory, dev_certs):
    """The cluster, shared by this module's tests (read-mostly; keys are test-specific)."""
    etcd = require_tool("etcd", "/usr/bin/etcd")
    tmp_path = tmp_path_factory.mktemp("etcd3")
    envs = member_envs(read_env_file(ETCD_ENV), dev_certs, tmp_path)
    procs, logs = [], []
    try:
        for env in envs:
            log = tmp_path / f"{env['ETCD_NAME']}.log"
            logs.append(log)
            with open(log, "wb") as out:
                procs.append(subprocess.Popen([etcd], env={"PATH": "/usr/bin:/bin", **env},
                                              stdout=out, stderr=subprocess.STDOUT))
        urls = [env["ETCD_ADVERTISE_CLIENT_URLS"] for env in envs]
        wait_healthy(urls, client_context(dev_certs), procs, logs)
        yield envs, urls, logs
    finally:
        # SIGKILL: a graceful stop hands leadership over first (seconds per member), and
        # the data directories are throw-away.
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_template_uses_tls_everywhere():
    env = read_env_file(ETCD_ENV)
    urls = [m.group(0) for v in env.values() for m in URL.finditer(v)]
    assert urls and all(u.startswith("https://") for u in urls)
    assert env["ETCD_CLIENT_CERT_AUTH"] == "true" and env["ETCD_PEER_CLIENT_CERT_AUTH"] == "true"


def test_three_members_form_one_cluster_and_replicate_over_tls(tls_cluster, dev_certs):
    envs, urls, logs = tls_cluster
    context = client_context(dev_certs)
    members = https_json(f"{urls[0]}/v3/cluster/member/list", context, {})["members"]
    assert sorted(m["name"] for m in members) == ["etcd1", "etcd2", "etcd3"]
    assert all(u.startswith("https://") for m in members for u in m["peerURLs"])

    https_json(f"{urls[0]}/v3/kv/put", context, {"key": _b64("/tpflex/v1/probe"), "value": _b64("ok")})
    got = https_json(f"{urls[2]}/v3/kv/range", context, {"key": _b64("/tpflex/v1/probe")})
    assert base64.b64decode(got["kvs"][0]["value"]) == b"ok"
    for log in logs:
        assert "unrecognized environment variable" not in log.read_text()


def test_clients_without_a_trusted_certificate_are_refused(tls_cluster, dev_certs, tmp_path):
    _envs, urls, _logs = tls_cluster
    with pytest.raises(OSError):
        https_json(f"{urls[1]}/v3/kv/range", client_context(dev_certs, None), {"key": _b64("x")})
    other = tmp_path / "other-ca"
    assert make_certs(other).returncode == 0
    foreign = client_context(dev_certs, None)
    foreign.load_cert_chain(other / "controller.pem", other / "controller-key.pem")
    with pytest.raises(OSError):
        https_json(f"{urls[1]}/v3/kv/range", foreign, {"key": _b64("x")})
