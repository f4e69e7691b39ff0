"""Issue 16, defects 3 and 7: hostile REST input against a real ``tpflex-controller``
process (real uvicorn, real etcd), over raw sockets where a client library would not send
what an attacker sends. Memory is the controller's own, read from /proc.

Before the fix: an unauthenticated body was read whole before the 401 (the peak RSS grew
by the bodies' size), nested JSON and invalid UTF-8 got 400, ``/v1/nodes/%2f`` redirected,
``1.0``/``+1``/``01`` were accepted as GPU indices, and control characters as reasons."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest
from tpflex_proto import keys

from tests.agent.support import wait_until
from tests.controller.controller_harness import ControllerProc, put_job, small_cluster
from tests.reliability.fleet import ADMIN, ADMIN_TOKEN, record
from tests.support.rest import rest_error

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

MB = 1 << 20


@pytest.fixture(scope="module")
def ctl(tmp_path_factory):
    from tpflex_proto.etcd import Etcd

    from tests.support.etcd_server import EtcdCluster

    base = tmp_path_factory.mktemp("hostile-rest")
    cluster = EtcdCluster(1, base / "etcd").start()
    etcd = Etcd(cluster.endpoints, timeout=2.0)
    put_job(etcd, small_cluster(etcd))
    (base / "admin.tokens").write_text(ADMIN_TOKEN + "\n")
    env = {"TPFLEX_REST__MAX_CONCURRENT_BODIES": "2", "TPFLEX_REST__BUSY_WAIT_S": "0.5",
           "TPFLEX_REST__BODY_TIMEOUT_S": "6"}
    proc = ControllerProc(cluster.endpoints, "c1", base, env=env,
                          extra=["--admin-tokens-file", str(base / "admin.tokens")])
    try:
        proc.wait_http()
        proc.etcd = etcd
        yield proc
    finally:
        proc.kill()
        etcd.close()
        cluster.stop()


def _kb(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _raw(port: int, head: str, body_bytes: int, chunk: bytes = b"x" * MB) -> tuple[str, int]:
    """Send ``head`` then stream ``body_bytes`` of body while reading the answer; returns
    the status line and how many body bytes were sent before the answer came."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sent = 0
    answered = threading.Event()

    def stream():
        nonlocal sent
        try:
            while sent < body_bytes and not answered.is_set():
                n = min(len(chunk), body_bytes - sent)
                sock.sendall(chunk[:n])
                sent += n
        except OSError:
            pass  # the server answered and closed the connection: nothing more to send

    sock.sendall(head.encode())
    sender = threading.Thread(target=stream, daemon=True)
    sender.start()
    try:
        data = sock.recv(4096)
    finally:
        answered.set()
        sent_then = sent
        sender.join(30)
        sock.close()
    return data.split(b"\r\n", 1)[0].decode(errors="replace"), sent_then


def _head(path: str, length: int | None, token: str | None = None) -> str:
    lines = [f"POST {path} HTTP/1.1", "Host: controller", "Content-Type: application/json"]
    lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
    if token:
        lines.append(f"Authorization: Bearer {token}")
    return "\r\n".join(lines) + "\r\n\r\n"


def test_bodies_are_read_only_after_the_token_and_bounded_in_size_and_number(ctl):
    # the REST API runs in a child of the controller: the bodies land there
    port = ctl.rest_port
    [rest_pid] = ctl.rest_pids()
    pids = {"controller": ctl.proc.pid, "rest": rest_pid}
    hwm_before = {name: _kb(pid, "VmHWM") for name, pid in pids.items()}
    size = 128 * MB
    path = "/v1/jobs/job1/reconfigure"
    jobs = [(_head(path, size), size)] * 6 + [(_head(path, size, ADMIN_TOKEN), size)] * 2
    results: list[tuple[str, int]] = [("", 0)] * len(jobs)

    def run(i):
        results[i] = _raw(port, *jobs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    statuses = [r[0] for r in results]
    assert all(" 401 " in s for s in statuses[:6]), statuses  # no token: refused unread
    assert all(" 413 " in s for s in statuses[6:]), statuses  # admin, too long: refused unread
    assert httpx.get(f"{ctl.rest_url}/v1/status", timeout=10).status_code == 200
    # chunked (no Content-Length): the admin body is cut off once it passes the limit
    status, sent = _raw(port, _head(path, None, ADMIN_TOKEN), 64 * MB,
                        chunk=b"100000\r\n" + b"x" * 0x100000 + b"\r\n")
    assert " 413 " in status and sent < 64 * MB, (status, sent)
    assert ctl.rest_pids() == [rest_pid], "the REST process was restarted (it died) during the bodies"
    grown = {name: (_kb(pid, "VmHWM") - hwm_before[name]) / 1024 for name, pid in pids.items()}
    assert all(mb < 48 for mb in grown.values()), f"peak RSS grew by {grown} MB for {8 * size // MB} MB of bodies"
    grown_mb = grown["rest"]
    record("rest_bodies", f"6 unauthenticated and 2 admin {size // MB} MB POST bodies at once, "
           "streamed over raw sockets, plus a chunked admin body of 64 MB",
           "401 / 413 before the body is read; /v1/status answers; the peak RSS (VmHWM) of the "
           "REST process and of the controller grows by less than 48 MB",
           {"bodies_mb": 8 * size // MB + 64, "peak_rss_growth_mb": round(grown_mb, 1),
            "controller_peak_rss_growth_mb": round(grown["controller"], 1)})


def test_concurrent_bodies_are_bounded_and_a_trickled_body_times_out(ctl):
    port = ctl.rest_port
    held = []
    for _ in range(2):  # rest.max_concurrent_bodies = 2: two admin bodies that never finish
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(_head("/v1/jobs/job1/reconfigure", 1000, ADMIN_TOKEN).encode() + b"{")
        held.append(s)
    try:
        # while both slots are held, another body waits rest.busy_wait_s and is told busy
        wait_until(lambda: httpx.post(f"{ctl.rest_url}/v1/jobs/job1/reconfigure", json={"clear": True},
                                      headers=ADMIN, timeout=30).status_code == 503,
                   5, "a third body refused busy")
        assert httpx.get(f"{ctl.rest_url}/v1/status", timeout=10).status_code == 200  # reads go on
        answers = [s.recv(4096).split(b"\r\n", 1)[0] for s in held]  # rest.body_timeout_s = 6
        assert all(b" 408 " in a for a in answers), answers
    finally:
        for s in held:
            s.close()
    ok = httpx.post(f"{ctl.rest_url}/v1/jobs/job1/reconfigure", json={"clear": True}, headers=ADMIN,
                    timeout=30)
    assert ok.status_code == 202, ok.text  # the slots are free again


def _err(resp: httpx.Response, status: int, *words: str) -> None:
    rest_error(resp, status, *words)


def test_the_error_contract_holds_for_malformed_bodies_paths_and_text(ctl):
    url, rev = ctl.rest_url, ctl.etcd.get_prefix(keys.PREFIX)[1]
    http = httpx.Client(base_url=url, timeout=10, follow_redirects=False)
    reconf = "/v1/jobs/job1/reconfigure"
    nested = "[" * 100_000 + "]" * 100_000
    _err(http.post(reconf, content=nested, headers={**ADMIN, "Content-Type": "application/json"}), 422)
    _err(http.post(reconf, content=b'{"reason": "\xff\xfe"}',
                   headers={**ADMIN, "Content-Type": "application/json"}), 422, "UTF-8")
    for path in ("/v1/nodes/%2f", "/v1/nodes/%2f/gpus/0", "/v1/jobs/%2f", "/v1/racks/%2f",
                 "/v1/jobs/job1/%2f", "/v1/nodes/rack0-n00/gpus/%2f"):
        r = http.get(path)
        assert r.status_code in (404, 422) and "location" not in r.headers, (path, r.status_code)
        _err(r, r.status_code)
    for index in ("1.0", "+1", "01", "%201", "1_0", "0x1", "%EF%BC%91", "-0", "1e0"):
        _err(http.get(f"/v1/nodes/rack0-n00/gpus/{index}"), 422, "index")
        _err(http.post(f"/v1/nodes/rack0-n00/gpus/{index}/drain", json={"reason": "x"}, headers=ADMIN),
             422, "index")
    assert http.get("/v1/nodes/rack0-n00/gpus/1").status_code == 200  # the canonical form works
    for reason in ("a\x00b", "line\nbreak", "\x1b[31mred", "tab\there", "del\x7f", "c1\x85"):
        _err(http.post("/v1/nodes/rack0-n00/gpus/1/drain", json={"reason": reason}, headers=ADMIN), 422, "reason")
        _err(http.post(reconf, json={"pins": [{"replica": 0, "tp_degree": 3}], "reason": reason},
                       headers=ADMIN), 422, "reason")
    for path in ("/v1/jobs/a%00b", "/v1/nodes/a%0Ab", "/v1/racks/a%1Bb", "/v1/jobs/a%20b"):
        _err(http.get(path), 422)
    for query in ("limit=1.0", "limit=%2B1", "limit=01", "limit=0", "job=a%00b"):
        _err(http.get(f"/v1/events?{query}"), 422)
    _err(http.post("/v1/jobs/job1/dry-run", json={"fail": [{"node": "n\x00", "index": 0}]}), 422, "node")
    assert ctl.etcd.get_prefix(keys.PREFIX)[1] == rev  # nothing refused changed etcd
    http.close()
