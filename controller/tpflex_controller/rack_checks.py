"""Rack records from outside (the REST API's rack inventory, ``tpflexctl racks apply``),
checked before they are stored (pure: no I/O; the callers pass state in).

- ``check_rack``: a record the planner can use: a domain of at least one GPU that is
  exactly its nodes x ``gpus_per_node``, distinct valid node names, power limits in order
  (min <= TDP <= max) and a budget that can hold every GPU at its minimum;
- ``jobs_using``: the registered jobs whose stages or spare racks name a rack;
- ``check_jobs_fit``: every job that uses the rack still passes the spec checks with the
  new record (None = the rack deleted) — a change that would leave one unplannable is a
  conflict.

Failures are ``spec_checks.InputError`` (``invalid`` -> HTTP 422, ``conflict`` -> 409).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from tpflex_proto import keys, types_pb2

from tpflex_controller.spec_checks import InputError, check_spec

# the fields of a rack record an operator writes (types.proto ``Rack``), in its order
FIELDS = ("name", "domain_size", "power_budget_w", "gpu_tdp_w", "gpu_min_w", "gpu_max_w", "nodes",
          "gpus_per_node")
MAX_NODES = 4096
MAX_GPUS_PER_NODE = 1024
MAX_GPU_WATTS = 100_000.0


def _invalid(message: str) -> InputError:
    return InputError("invalid", message)


def name_ok(name: str) -> bool:
    """A node or rack name as etcd keys take it (``keys.NAME_PATTERN``, no trailing newline)."""
    return keys.NAME_PATTERN.fullmatch(name) is not None


_NAME_RULE = "1-63 of A-Z a-z 0-9 . _ - starting with a letter or digit"


def check_rack(rack: types_pb2.Rack) -> None:
    """:class:`InputError` (``invalid``) naming the first thing wrong with ``rack``."""
    name = rack.name
    if not name_ok(name):
        raise _invalid(f"rack name must be {_NAME_RULE}, got {name[:70]!r}")
    where = f"rack {name}"
    if not rack.nodes:
        raise _invalid(f"{where}: nodes must list at least one node")
    if len(rack.nodes) > MAX_NODES:
        raise _invalid(f"{where}: at most {MAX_NODES} nodes, got {len(rack.nodes)}")
    seen: set[str] = set()
    for node in rack.nodes:
        if not name_ok(node):
            raise _invalid(f"{where}: node name must be {_NAME_RULE}, got {node[:70]!r}")
        if node in seen:
            raise _invalid(f"{where}: node {node} is listed twice")
        seen.add(node)
    if not 1 <= rack.gpus_per_node <= MAX_GPUS_PER_NODE:
        raise _invalid(f"{where}: gpus_per_node must be in 1..{MAX_GPUS_PER_NODE}, got {rack.gpus_per_node}")
    if rack.domain_size < 1:
        raise _invalid(f"{where}: domain_size must be at least 1, got {rack.domain_size}")
    gpus = len(rack.nodes) * rack.gpus_per_node
    if rack.domain_size != gpus:
        raise _invalid(f"{where}: domain_size {rack.domain_size} is not its {len(rack.nodes)} node(s) x "
                       f"gpus_per_node {rack.gpus_per_node} = {gpus} GPUs")
    for field in ("gpu_min_w", "gpu_tdp_w", "gpu_max_w"):
        value = getattr(rack, field)
        if not (math.isfinite(value) and 0 < value <= MAX_GPU_WATTS):
            raise _invalid(f"{where}: {field} must be a number of watts in (0, {MAX_GPU_WATTS:g}], got {value!r}")
    if not rack.gpu_min_w <= rack.gpu_tdp_w <= rack.gpu_max_w:
        raise _invalid(f"{where}: power limits must be gpu_min_w <= gpu_tdp_w <= gpu_max_w, got "
                       f"{rack.gpu_min_w:g} / {rack.gpu_tdp_w:g} / {rack.gpu_max_w:g} W")
    budget = rack.power_budget_w
    if not (math.isfinite(budget) and budget > 0):
        raise _invalid(f"{where}: power_budget_w must be a positive number of watts, got {budget!r}")
    floor = rack.domain_size * rack.gpu_min_w
    if budget < floor:
        raise _invalid(f"{where}: power_budget_w {budget:g} W is below domain_size {rack.domain_size} x "
                       f"gpu_min_w {rack.gpu_min_w:g} W = {floor:g} W: the GPUs cannot all run")


def jobs_using(rack: str, specs: Mapping[str, types_pb2.JobSpec]) -> list[str]:
    """The jobs (sorted) whose stages or spare racks name ``rack``."""
    return sorted(
        name for name, spec in specs.items()
        if rack in spec.spare_racks or any(st.rack == rack for rep in spec.replicas for st in rep.stages)
    )


def check_jobs_fit(
    rack: str, new: types_pb2.Rack | None, racks: Mapping[str, types_pb2.Rack],
    specs: Mapping[str, types_pb2.JobSpec],
) -> list[str]:
    """The jobs that use ``rack``, each checked as a new spec would be against the racks
    with ``new`` in place of the stored record (None: the rack deleted). A job that would
    no longer pass is an :class:`InputError` ``conflict`` naming it and why."""
    users = jobs_using(rack, specs)
    if not users:
        return users
    if new is None:
        raise InputError("conflict", f"rack {rack} is used by job(s) {', '.join(users)} (a stage or a "
                                     f"spare rack): delete or change those jobs first")
    changed = {**racks, rack: new}
    for job in users:
        others = {n: s for n, s in specs.items() if n != job}
        try:
            check_spec(specs[job], changed, others)
        except InputError as exc:
            raise InputError("conflict", f"rack {rack}: job {job} uses it and could not be planned with "
                                         f"this record: {exc.message}") from None
    return users
