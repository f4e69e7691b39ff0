"""The private link between the controller and its REST child process (api/process.py).

The REST API runs in its own process; two things it serves live in the controller
process: the Prometheus registry (the decision loop's metrics) and the trainers' step
reports (goodput). The child asks for them over a socket pair the controller made: one
request line (JSON), one length-prefixed answer. Requests are rare (a metrics scrape, a
job read) and cost the controller O(the answer).
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
from dataclasses import asdict

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tpflex_controller.steps import Goodput, StepStats

log = logging.getLogger(__name__)

_LEN = struct.Struct("!I")


def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("link closed")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> bytes:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    return _recv_exact(sock, n)


class LinkServer:
    """Controller side: answers the child's requests on its own thread until EOF."""

    def __init__(self, sock: socket.socket, registry: CollectorRegistry, steps: StepStats | None) -> None:
        self._sock, self._registry, self._steps = sock, registry, steps
        self._thread = threading.Thread(target=self._serve, name="rest-link", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while True:
                _send(self._sock, self._answer(json.loads(_recv(self._sock))))
        except (ConnectionError, OSError, ValueError):
            pass
        finally:
            self._sock.close()

    def _answer(self, req: dict) -> bytes:
        if req.get("op") == "metrics":
            return generate_latest(self._registry)
        if req.get("op") == "goodput" and self._steps is not None:
            g = self._steps.goodput(str(req.get("job", "")))
            return json.dumps(asdict(g) if g is not None else None).encode()
        return b"null"

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class LinkClient:
    """Child side: ``goodput(job)`` (StepStats' read interface) and a Prometheus collector
    of the controller's metrics. One request at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()

    def _ask(self, req: dict) -> bytes:
        with self._lock:
            _send(self._sock, json.dumps(req).encode())
            return _recv(self._sock)

    def goodput(self, job: str) -> Goodput | None:
        try:
            d = json.loads(self._ask({"op": "goodput", "job": job}))
        except (ConnectionError, OSError) as exc:
            log.warning("controller link failed op=goodput error=%s", exc)
            return None
        return Goodput(**d) if d is not None else None

    def collect(self):
        """The controller's metric families, read at scrape time."""
        try:
            text = self._ask({"op": "metrics"}).decode()
        except (ConnectionError, OSError) as exc:
            log.warning("controller link failed op=metrics error=%s", exc)
            return
        yield from text_string_to_metric_families(text)
