"""Free-port helpers: single ports live in ``tpflex_controller.devtools``; a free range for the
demo cluster's fixed port layout is here."""

from __future__ import annotations

import random

from tpflex_controller.devtools.ports import free_port, free_ports  # noqa: F401
from tpflex_trainer.demo.cluster import DemoPorts, PortsTaken, check_ports_free


def free_base_port(n_agents: int, tries: int = 50) -> int:
    """A base port whose whole demo range (``n_agents`` agents) is free, below the
    ephemeral range (where gloo's and gRPC's client sockets could take a port between the
    check and the bind)."""
    rng = random.Random()
    for _ in range(tries):
        base = rng.randrange(20000, 32000, 20)
        try:
            check_ports_free(DemoPorts(base).all(n_agents))
            return base
        except PortsTaken:
            continue
    raise RuntimeError("no free demo port range found")
