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
import time
from dataclasses import asdict

from prometheus_client import CollectorRegistry, generate_latest

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
        if req.get("op") == "goodput_all" and self._steps is not None:
            every = {job: self._steps.goodput(job) for job in self._steps.jobs()}
            return json.dumps({job: asdict(g) for job, g in every.items() if g is not None}).encode()
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
    """Child side: ``goodput(job)`` (StepStats' read interface) and ``metrics_text()``,
    the controller's metrics. One request at a time.

    Goodput is asked for every job at once and kept ``goodput_ttl_s`` (default 1 s): a
    job read then costs no round trip to the controller (whose answer waits for the
    decision loop's GIL). A read between one and two TTLs after the last answer starts a
    refresh on a thread of its own and is answered with what is kept, so while jobs are
    read steadily no request (the response cache asks on the event loop) waits for the
    controller, or for a metrics scrape holding the link; the first read, and one after a
    quiet spell of two TTLs or more, waits for the answer (never older than two TTLs)."""

    def __init__(self, sock: socket.socket, goodput_ttl_s: float = 1.0,
                 clock=time.monotonic) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._ttl, self._clock = goodput_ttl_s, clock
        self._goodput: dict[str, Goodput] = {}
        self._fetched_at: float | None = None
        self._refreshed = threading.Condition()
        self._refreshing = False
        self.refreshes = 0  # answers (or failures) folded in since the start

    def _ask(self, req: dict) -> bytes:
        with self._lock:
            _send(self._sock, json.dumps(req).encode())
            return _recv(self._sock)

    def goodput(self, job: str) -> Goodput | None:
        now = self._clock()
        if self._fetched_at is None or now - self._fetched_at >= 2 * self._ttl:
            self._refresh(now)  # nothing kept, or kept from before a quiet spell: asked here
        elif now - self._fetched_at >= self._ttl:
            with self._refreshed:
                start, self._refreshing = not self._refreshing, True
            if start:
                threading.Thread(target=self._refresh, args=(now,), name="rest-goodput", daemon=True).start()
        return self._goodput.get(job)

    def _refresh(self, now: float) -> None:
        try:
            every = json.loads(self._ask({"op": "goodput_all"})) or {}
            self._goodput = {name: Goodput(**d) for name, d in every.items()}
        except (ConnectionError, OSError) as exc:
            log.warning("controller link failed op=goodput error=%s", exc)
        finally:
            self._fetched_at = now  # a failure is retried after the TTL too
            with self._refreshed:
                self._refreshing = False
                self.refreshes += 1
                self._refreshed.notify_all()

    def wait_refreshes(self, n: int, timeout: float) -> bool:
        """Block until ``n`` refreshes have been folded in (tests)."""
        with self._refreshed:
            return self._refreshed.wait_for(lambda: self.refreshes >= n, timeout)

    def metrics_text(self) -> bytes:
        """The controller's metrics in the text exposition format, as it wrote them (b""
        when the link fails): served ahead of the REST process's own. Parsing them into
        families and writing them out again held the GIL for seconds a scrape at 10,000
        nodes (py-spy on the REST process), stalling every request."""
        try:
            return self._ask({"op": "metrics"})
        except (ConnectionError, OSError) as exc:
            log.warning("controller link failed op=metrics error=%s", exc)
            return b""
