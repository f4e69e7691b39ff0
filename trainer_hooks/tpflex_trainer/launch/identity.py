"""Which node this launcher runs on (pure: the environment is an argument).

Precedence, first match wins:
1. ``--node NAME``;
2. Slurm: inside an ``srun`` step (``SLURM_JOB_ID`` and ``SLURMD_NODENAME`` set) the node
   is ``SLURMD_NODENAME``; the step must run one task per node;
3. Kubernetes: in a pod (``KUBERNETES_SERVICE_HOST`` set) the node is ``NODE_NAME``, set
   from the downward API (``fieldRef: spec.nodeName``);
4. the host name (up to its first dot).
The name must be what the node's agent registers (``[agent] node``).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from tpflex_proto import keys


class IdentityError(ValueError):
    """The node cannot be told, or the launch layout is wrong; the message says why."""


@dataclass(frozen=True)
class NodeIdentity:
    name: str
    source: str  # argument / slurm / kubernetes / hostname


def _tasks_per_node(value: str) -> list[int]:
    """Slurm's compressed list, e.g. ``"1(x4)"`` or ``"2,1"`` -> [1, 1, 1, 1] / [2, 1]."""
    out: list[int] = []
    for part in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise IdentityError(f"SLURM_STEP_TASKS_PER_NODE: cannot read {value!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def resolve_node(argument: str | None, env: Mapping[str, str], hostname: str | None = None) -> NodeIdentity:
    if argument:
        found = NodeIdentity(argument, "argument")
    elif env.get("SLURM_JOB_ID") and env.get("SLURMD_NODENAME"):
        tasks = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
        if tasks and any(n != 1 for n in _tasks_per_node(tasks)):
            raise IdentityError(
                f"srun runs {tasks} tasks per node; tpflex-run starts the node's ranks itself: "
                "run one task per node (srun --ntasks-per-node=1)"
            )
        found = NodeIdentity(env["SLURMD_NODENAME"], "slurm")
    elif env.get("KUBERNETES_SERVICE_HOST") and env.get("NODE_NAME"):
        found = NodeIdentity(env["NODE_NAME"], "kubernetes")
    elif env.get("KUBERNETES_SERVICE_HOST"):
        raise IdentityError("in a Kubernetes pod without NODE_NAME: set it from the downward API "
                            "(fieldRef: spec.nodeName) or pass --node")
    else:
        found = NodeIdentity((hostname or socket.gethostname()).split(".")[0], "hostname")
    if not keys.name_ok(found.name):
        raise IdentityError(f"node name {found.name!r} (from {found.source}) must be 1-63 letters, "
                            "digits, '.', '_' or '-'")
    return found
