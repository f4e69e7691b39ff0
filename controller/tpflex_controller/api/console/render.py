"""Pure renderings of the API's state into the console's compact JSON.

A rack is sent as one string of state codes, one character per GPU in the rack's order
(its ``nodes`` x ``gpus_per_node``), plus the caps that differ from the rack's TDP, so
that 1,024 racks of 72 GPUs stay a few hundred kB. GPU states are the planner's own view
(``convert.cluster_state``): a GPU on a node whose lease lapsed is failed, a drained GPU
is drained unless it has failed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from tpflex_proto import types_pb2

from tpflex_controller.api import views
from tpflex_controller.planner.model import ClusterState, GpuKey, GpuStatus
from tpflex_controller.steps import Goodput

STATE_CODE = {
    GpuStatus.HEALTHY: "h",
    GpuStatus.DEGRADED: "g",
    GpuStatus.FAILED: "f",
    GpuStatus.DRAINED: "d",
}

_REPLICA_STATE = {
    types_pb2.REPLICA_HEALTHY: "healthy",
    types_pb2.REPLICA_DEGRADED: "degraded",
    types_pb2.REPLICA_DROPPED: "dropped",
    types_pb2.REPLICA_ON_SPARE: "on-spare",
}


def plan_caps(plans: Iterable[types_pb2.Plan]) -> dict[GpuKey, float]:
    """Desired power caps of every GPU whose cap differs from its rack's TDP."""
    return {(c.gpu.node, c.gpu.index): c.cap_w for p in plans for c in p.power_caps}


def rack_gpus(rack: types_pb2.Rack) -> list[GpuKey]:
    return [(n, i) for n in rack.nodes for i in range(rack.gpus_per_node)]


def unhealthy_by_node(state: ClusterState) -> dict[str, dict[int, GpuStatus]]:
    """The GPUs ``state`` does not call healthy, per node (few, next to all GPUs)."""
    out: dict[str, dict[int, GpuStatus]] = {}
    for (node, index), status in state.gpu_status.items():
        out.setdefault(node, {})[index] = status
    return out


def rack_codes(rack: types_pb2.Rack, state: ClusterState,
               unhealthy: Mapping[str, Mapping[int, GpuStatus]]) -> str:
    """One code per GPU, equal to ``STATE_CODE[state.status(gpu)]`` for each of the rack's
    GPUs, computed per node (73,728 GPUs in tens of ms): a node whose lease lapsed is all
    failed, a node with no unhealthy GPU all healthy."""
    gpn, live = rack.gpus_per_node, state.live_nodes
    parts = []
    for node in rack.nodes:
        if live is not None and node not in live:
            parts.append("f" * gpn)
        elif node not in unhealthy:
            parts.append("h" * gpn)
        else:
            bad = unhealthy[node]
            parts.append("".join(STATE_CODE[bad.get(i, GpuStatus.HEALTHY)] for i in range(gpn)))
    return "".join(parts)


def render_rack(rack: types_pb2.Rack, state: ClusterState, caps: Mapping[GpuKey, float],
                unhealthy: Mapping[str, Mapping[int, GpuStatus]] | None = None) -> dict:
    """``unhealthy``: :func:`unhealthy_by_node` of ``state``, when the caller renders many racks."""
    gpus = rack_gpus(rack)
    codes = rack_codes(rack, state, unhealthy if unhealthy is not None else unhealthy_by_node(state))
    rack_caps = {str(i): caps[g] for i, g in enumerate(gpus) if g in caps and caps[g] != rack.gpu_tdp_w}
    return {
        "name": rack.name, "nodes": list(rack.nodes), "gpn": rack.gpus_per_node,
        "tdp": rack.gpu_tdp_w, "max": rack.gpu_max_w, "budget": rack.power_budget_w,
        "s": codes, "caps": rack_caps,
    }


def render_job(
    spec: types_pb2.JobSpec,
    plan: types_pb2.Plan | None,
    override: types_pb2.JobOverride | None,
    acks: Mapping[int, types_pb2.Ack],
    goodput: Goodput | None,
) -> dict:
    replicas = []
    for r in plan.replicas if plan is not None else ():
        replicas.append({
            "index": r.index, "state": _REPLICA_STATE.get(r.state, "unknown"),
            "tp": r.tp_degree, "batch": r.local_batch, "reason": r.reason,
            "throughput": r.relative_throughput, "racks": [st.rack for st in r.stages],
        })
    if plan is None:  # not planned yet: the spec's racks, so that drain previews find the job
        replicas = [
            {"index": i, "state": "unplanned", "tp": 0, "batch": 0, "reason": "", "throughput": 0.0,
             "racks": [st.rack for st in rep.stages]}
            for i, rep in enumerate(spec.replicas)
        ]
    generation = plan.generation if plan is not None else None
    return {
        "name": spec.name, "base_tp": spec.base_tp, "min_tp": spec.min_tp or 1,
        "policy": (override.policy if override and override.policy else spec.policy) or "ntp-pw",
        "generation": generation, "cause": plan.cause if plan is not None else "",
        "ratio": plan.expected_throughput_ratio if plan is not None else None,
        "reasons": list(plan.reasons) if plan is not None else [],
        "pins": {str(p.replica): p.tp_degree for p in override.pins} if override else {},
        "acked_current": sum(a.generation == generation for a in acks.values()),
        "goodput": dataclasses.asdict(goodput) if goodput is not None else None,
        "replicas": replicas,
    }


def render_event(e: types_pb2.Event) -> dict:
    return views.event_view(e).model_dump(mode="json")
