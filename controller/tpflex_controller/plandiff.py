"""What a new plan changes against the current one (pure): the console and ``tpflexctl
dry-run`` show it before an operator commits a drain or a pin.

A change is ``(kind, replica, gpu, field, before, after)``: kind ``plan`` (policy,
expected throughput), ``replica`` (state, TP degree, local batch, the GPUs it uses) or
``power_cap`` (a GPU's cap; ``None`` = the rack's TDP, as plans list only other caps).
No change, no entry: ``diff(p, p) == []``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpflex_proto import types_pb2

GpuKey = tuple[str, int]

_REPLICA_STATE = {
    types_pb2.REPLICA_HEALTHY: "healthy",
    types_pb2.REPLICA_DEGRADED: "degraded",
    types_pb2.REPLICA_DROPPED: "dropped",
    types_pb2.REPLICA_ON_SPARE: "on-spare",
}
ABSENT = "absent"  # a replica missing from one side


@dataclass(frozen=True, slots=True)
class PlanChange:
    kind: str  # "plan" | "replica" | "power_cap"
    field: str
    before: object
    after: object
    replica: int | None = None
    gpu: GpuKey | None = None


def _replica_fields(r: types_pb2.ReplicaPlan | None) -> dict[str, object]:
    if r is None:
        return {"state": ABSENT, "tp_degree": 0, "local_batch": 0, "gpus": ()}
    gpus = tuple(f"{g.node}:{g.index}" for st in r.stages for g in st.gpus)
    return {"state": _REPLICA_STATE.get(r.state, "unknown"), "tp_degree": r.tp_degree,
            "local_batch": r.local_batch, "gpus": gpus}


def _caps(plan: types_pb2.Plan | None) -> dict[GpuKey, float]:
    return {(c.gpu.node, c.gpu.index): c.cap_w for c in plan.power_caps} if plan else {}


def diff(current: types_pb2.Plan | None, proposed: types_pb2.Plan) -> list[PlanChange]:
    """Every field of ``proposed`` that differs from ``current`` (None: no plan yet)."""
    out: list[PlanChange] = []
    for field in ("policy", "expected_throughput_ratio"):
        before = getattr(current, field) if current is not None else None
        after = getattr(proposed, field)
        if before != after:
            out.append(PlanChange("plan", field, before, after))
    old = {r.index: r for r in current.replicas} if current is not None else {}
    new = {r.index: r for r in proposed.replicas}
    for index in sorted(old.keys() | new.keys()):
        a, b = _replica_fields(old.get(index)), _replica_fields(new.get(index))
        for field in a:
            if a[field] != b[field]:
                out.append(PlanChange("replica", field, _plain(a[field]), _plain(b[field]), replica=index))
    before_caps, after_caps = _caps(current), _caps(proposed)
    for gpu in sorted(before_caps.keys() | after_caps.keys()):
        if before_caps.get(gpu) != after_caps.get(gpu):
            out.append(PlanChange("power_cap", "cap_w", before_caps.get(gpu), after_caps.get(gpu), gpu=gpu))
    return out


def _plain(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value
