"""``rest.keep_alive_s``: the REST child closes an idle keep-alive connection after the
configured time (uvicorn's own default is 5 s)."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

from tests.controller.controller_harness import ControllerProc, small_cluster


def _get(sock: socket.socket, host: str) -> bytes:
    sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, "the server closed the connection before answering"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(4096)
    return head.split(b"\r\n")[0]


def test_an_idle_connection_is_closed_after_keep_alive_s(etcd_server, etcd, tmp_path):
    small_cluster(etcd)
    proc = ControllerProc(etcd_server.endpoints, "c1", tmp_path, env={"TPFLEX_REST__KEEP_ALIVE_S": "1"})
    try:
        proc.wait_http()
        url = urlsplit(proc.rest_url)
        with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
            assert b" 200 " in _get(sock, url.netloc)
            assert b" 200 " in _get(sock, url.netloc)  # kept alive between two requests
            idle_from = time.monotonic()
            sock.settimeout(4.0)  # under uvicorn's default (5 s) this recv would time out
            assert sock.recv(1) == b"", "the server sent data on an idle connection"
            assert time.monotonic() - idle_from < 4.0
    finally:
        proc.kill()
