"""Free loopback ports for tests, benchmarks and the development launchers.

Ports come from below the kernel's ephemeral range (``net.ipv4.ip_local_port_range``,
32768-60999 by default) and below the demo cluster's port ranges (20000-32000): a port
the kernel handed out for ``bind(0)`` is released before its user binds it again, and in
that gap an outgoing connection (gloo's pairs, gRPC and etcd clients) may take it as its
local port, after which the bind fails or, worse, a client talks to the wrong peer.

When the test suite runs in parallel (pytest-xdist sets ``PYTEST_XDIST_WORKER`` = ``gwK``
and ``PYTEST_XDIST_WORKER_COUNT`` = N in each worker, and the processes a test starts
inherit them), each worker picks from its own K-th slice of a range (`worker_slice`), so
two workers never both take a port that was free a moment ago.
"""

from __future__ import annotations

import os
import random
import socket

_LOW, _HIGH = 10000, 20000
_rng = random.SystemRandom()


def worker_slice(low: int, high: int, step: int = 1) -> range:
    """The part of ``range(low, high, step)`` this test worker may use: all of it outside a
    parallel test run, else the worker's own contiguous slice (see the module's doc)."""
    full = range(low, high, step)
    try:
        k = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
        n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    except ValueError:
        return full
    if n <= 1 or not 0 <= k < n:
        return full
    size = len(full) // n
    return full[k * size:(k + 1) * size]


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int, tries: int = 200) -> list[int]:
    """``n`` distinct ports that were free a moment ago (outside the ephemeral range)."""
    picked: list[int] = []
    ours = worker_slice(_LOW, _HIGH)
    for _ in range(tries):
        port = _rng.choice(ours)
        if port not in picked and _bindable(port):
            picked.append(port)
            if len(picked) == n:
                return picked
    raise RuntimeError(f"no {n} free loopback ports in {ours.start}-{ours.stop} after {tries} tries")


def free_port() -> int:
    return free_ports(1)[0]
