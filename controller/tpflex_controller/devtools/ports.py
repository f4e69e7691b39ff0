"""Free loopback ports for tests, benchmarks and the development launchers.

Ports come from below the kernel's ephemeral range (``net.ipv4.ip_local_port_range``,
32768-60999 by default) and below the demo cluster's port ranges (20000-32000): a port
the kernel handed out for ``bind(0)`` is released before its user binds it again, and in
that gap an outgoing connection (gloo's pairs, gRPC and etcd clients) may take it as its
local port, after which the bind fails or, worse, a client talks to the wrong peer.
"""

from __future__ import annotations

import random
import socket

_LOW, _HIGH = 10000, 20000
_rng = random.SystemRandom()


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
    for _ in range(tries):
        port = _rng.randrange(_LOW, _HIGH)
        if port not in picked and _bindable(port):
            picked.append(port)
            if len(picked) == n:
                return picked
    raise RuntimeError(f"no {n} free loopback ports in {_LOW}-{_HIGH} after {tries} tries")


def free_port() -> int:
    return free_ports(1)[0]
