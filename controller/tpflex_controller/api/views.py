"""Pure conversions from stored state (protobufs, snapshots) to the API's response models.

A GPU's state is the planner's own view (``convert.cluster_state``): a GPU on a node whose
lease lapsed is failed, a drained GPU is drained unless it has failed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections import Counter
from collections.abc import Iterable

from tpflex_proto import types_pb2

from tpflex_controller import convert
from tpflex_controller.api import schemas as s
from tpflex_controller.planner.model import ClusterState, GpuKey, GpuStatus
from tpflex_controller.steps import Goodput
from tpflex_controller.store import Snapshot

_REPLICA_STATE = {
    types_pb2.REPLICA_HEALTHY: "healthy",
    types_pb2.REPLICA_DEGRADED: "degraded",
    types_pb2.REPLICA_DROPPED: "dropped",
    types_pb2.REPLICA_ON_SPARE: "on-spare",
}


def gpu_locations(snap: Snapshot, node: str | None = None) -> dict[GpuKey, str]:
    """Every GPU the controller knows of -> its rack: the racks' GPUs (registered or not)
    and the devices of registered nodes that no rack lists. ``node``: that node's GPUs
    only (the same entries, without deriving every GPU of its rack: a rack of 18 nodes
    made a one-node read build 72 GPUs' keys and views to keep 4)."""
    out: dict[GpuKey, str] = {}
    if node is not None:
        for rack in snap.racks.values():
            if node in rack.nodes:
                for i in range(rack.gpus_per_node):
                    out[(node, i)] = rack.name
        reg = snap.nodes.get(node)
        for dev in reg.gpus if reg is not None else ():
            out.setdefault((reg.name, dev.index), reg.rack)
        return out
    for rack in snap.racks.values():
        for gpu in convert.rack_info(rack).gpus:
            out[gpu] = rack.name
    for reg in snap.nodes.values():
        for dev in reg.gpus:
            out.setdefault((reg.name, dev.index), reg.rack)
    return out


def _health_by_gpu(snap: Snapshot) -> dict[GpuKey, types_pb2.GpuHealth]:
    return {(node, g.index): g for node, nh in snap.health.items() for g in nh.gpus}


def _devices_by_gpu(snap: Snapshot) -> dict[GpuKey, types_pb2.GpuDevice]:
    return {(n.name, d.index): d for n in snap.nodes.values() for d in n.gpus}


def gpu_views(snap: Snapshot, state: ClusterState | None = None, node: str | None = None) -> list[s.GpuView]:
    """The views of every GPU known, sorted; ``node``: of that node's GPUs only."""
    # a GPU's state does not depend on the racks' infos: one node's views skip deriving its rack's
    state = state or convert.cluster_state(snap, racks={} if node is not None else None)
    health = _health_by_gpu(snap)
    devices = _devices_by_gpu(snap)
    views = []
    for gpu, rack in sorted(gpu_locations(snap, node).items()):
        views.append(_gpu_view(gpu, rack, state, snap, health.get(gpu), devices.get(gpu)))
    return views


def _gpu_view(gpu, rack, state, snap, health, device) -> s.GpuView:
    status = state.status(gpu)
    live = gpu[0] in snap.nodes
    override = snap.gpu_overrides.get(gpu)
    drained = bool(override and override.drained)
    hold = snap.gpu_holds.get(gpu)
    if not live:
        reason = "node lease lapsed or node not registered"
    elif hold is not None and not (health and health.state == types_pb2.GPU_FAILED):
        reason = hold.reason  # reported healthy, still held by the leader's flap damping
    elif status is GpuStatus.DRAINED:
        reason = f"drained: {override.reason}" if override else "drained"
    else:
        reason = health.reason if health else ""
    view = s.GpuView(
        node=gpu[0], index=gpu[1], rack=rack, state=status.value, reason=reason, node_live=live,
        drained=drained, drain_reason=override.reason if drained else "",
    )
    if hold is not None:
        view.held, view.held_until, view.hold_reason = True, hold.until or None, hold.reason
    if device is not None:
        view.uuid, view.name, view.power_limit_w = device.uuid, device.name, device.power_limit_w
    if health is not None:
        view.power_draw_w, view.temperature_c = health.power_draw_w, health.temperature_c
        view.relative_speed = health.relative_speed or 1.0
        view.xids = list(health.xids)
        view.health_updated_at = health.updated_at or snap.health[gpu[0]].updated_at
        view.power_limit_w = health.power_limit_w or view.power_limit_w
    return view


def count_states(gpus: Iterable) -> s.GpuStateCounts:
    """How many of ``gpus`` (views or rows: anything with a ``state``) are in each state."""
    c = Counter(g.state for g in gpus)
    return s.GpuStateCounts(total=sum(c.values()), healthy=c["healthy"], degraded=c["degraded"],
                            failed=c["failed"], drained=c["drained"])


def rack_view(rack: types_pb2.Rack, gpus: Iterable) -> s.RackView:
    """``gpus``: the rack's GPU views (or rows: anything with a ``state``)."""
    return s.RackView(
        name=rack.name, domain_size=rack.domain_size or rack.gpus_per_node * len(rack.nodes),
        power_budget_w=rack.power_budget_w, gpu_tdp_w=rack.gpu_tdp_w, gpu_min_w=rack.gpu_min_w,
        gpu_max_w=rack.gpu_max_w, gpus_per_node=rack.gpus_per_node, nodes=list(rack.nodes),
        gpus=count_states(gpus),
    )


def node_names(snap: Snapshot) -> dict[str, str]:
    """Every node known (rack members and registered nodes) -> its rack."""
    out = {n: r.name for r in snap.racks.values() for n in r.nodes}
    for node in snap.nodes.values():
        out.setdefault(node.name, node.rack)
    return out


def node_view(name: str, rack: str, snap: Snapshot, gpus: list[s.GpuView]) -> s.NodeView:
    reg = snap.nodes.get(name)
    return s.NodeView(
        name=name, rack=reg.rack if reg else rack, live=reg is not None,
        agent_address=reg.agent_address if reg else "", backend=reg.backend if reg else "",
        registered_at=reg.registered_at if reg else 0.0, gpus=count_states(gpus),
    )


# ---- plans and jobs ----


def plan_decision(plan: types_pb2.Plan) -> s.PlanDecision:
    return s.PlanDecision(**_decision_fields(plan))


def plan_view(plan: types_pb2.Plan) -> s.PlanView:
    return s.PlanView(
        job=plan.job, generation=plan.generation, created_at=plan.created_at, cause=plan.cause,
        by=plan.by, **_decision_fields(plan),
    )


def _decision_fields(plan: types_pb2.Plan) -> dict:
    replicas = [
        s.ReplicaPlanView(
            index=r.index, state=_REPLICA_STATE.get(r.state, "unknown"), tp_degree=r.tp_degree,
            local_batch=r.local_batch, relative_throughput=r.relative_throughput, reason=r.reason,
            stages=[
                s.StagePlanView(
                    rack=st.rack, tp_degree=st.tp_degree, spec_stage=st.spec_stage,
                    gpus=[s.GpuRefView(node=g.node, index=g.index) for g in st.gpus],
                )
                for st in r.stages
            ],
        )
        for r in plan.replicas
    ]
    caps = [s.PowerCapView(node=c.gpu.node, index=c.gpu.index, cap_w=c.cap_w) for c in plan.power_caps]
    return dict(
        policy=plan.policy, expected_throughput_ratio=plan.expected_throughput_ratio,
        reasons=list(plan.reasons), replicas=replicas, power_caps=caps,
        suspended_pins=suspended_pins(plan),
    )


def plan_json(plan: types_pb2.Plan) -> bytes:
    """``plan_view(plan)`` as JSON, built from the protobuf directly: a plan lists every GPU
    and cap of a job (2,304 GPUs: 9 ms through the pydantic models, 4 ms as one document).
    Each replica's and each cap's JSON is kept by its encoding (``_replica_json``,
    ``_cap_json``): a new generation changes a few replicas and their caps, so a plan costs
    those plus a look-up per replica and cap (2,304 GPUs with 1,024 caps: about 2 ms instead
    of 7.4 ms); the bytes are those of one ``json.dumps`` of the whole view."""
    head = _dumps({"policy": plan.policy, "expected_throughput_ratio": plan.expected_throughput_ratio,
                   "reasons": list(plan.reasons)})
    replicas = ",".join([_replica_json(r.SerializeToString()) for r in plan.replicas])
    caps = ",".join([_cap_json(c.SerializeToString()) for c in plan.power_caps])
    tail = _dumps({
        "suspended_pins": [{"replica": p.replica, "tp_degree": p.tp_degree, "reason": p.reason}
                           for p in plan.suspended_pins],
        "job": plan.job, "generation": plan.generation, "created_at": plan.created_at, "cause": plan.cause,
        "by": plan.by,
    })
    return "".join((head[:-1], ',"replicas":[', replicas, '],"power_caps":[', caps, "],", tail[1:])).encode()


def _dumps(doc) -> str:
    return json.dumps(doc, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


@functools.lru_cache(maxsize=32768)
def _cap_json(raw: bytes) -> str:
    """One ``PowerCapView`` as JSON from the cap's encoding (pure; kept per encoding: caps
    repeat across generations: 1,024 caps cost 3.9 ms as dicts dumped, 1 ms kept)."""
    c = types_pb2.PowerCap.FromString(raw)
    return _dumps({"node": c.gpu.node, "index": c.gpu.index, "cap_w": c.cap_w})


@functools.lru_cache(maxsize=4096)
def _replica_json(raw: bytes) -> str:
    """One ``ReplicaPlanView`` as JSON from the replica's encoding (pure; kept per
    encoding, at most 4,096: a 72-GPU replica's is 2.4 kB)."""
    r = types_pb2.ReplicaPlan.FromString(raw)
    return _dumps({
        "index": r.index, "state": _REPLICA_STATE.get(r.state, "unknown"), "tp_degree": r.tp_degree,
        "local_batch": r.local_batch, "relative_throughput": r.relative_throughput, "reason": r.reason,
        "stages": [{"rack": st.rack, "tp_degree": st.tp_degree, "spec_stage": st.spec_stage,
                    "gpus": [{"node": g.node, "index": g.index} for g in st.gpus]}
                   for st in r.stages],
    })


def suspended_pins(plan: types_pb2.Plan) -> list[s.SuspendedPinView]:
    return [s.SuspendedPinView(replica=p.replica, tp_degree=p.tp_degree, reason=p.reason)
            for p in plan.suspended_pins]


def plan_summary(plan: types_pb2.Plan) -> s.PlanSummary:
    return s.PlanSummary(
        generation=plan.generation, policy=plan.policy,
        expected_throughput_ratio=plan.expected_throughput_ratio, created_at=plan.created_at,
        cause=plan.cause, by=plan.by, replica_tp_degrees=[r.tp_degree for r in plan.replicas],
        degraded_replicas=sum(r.state == types_pb2.REPLICA_DEGRADED for r in plan.replicas),
        dropped_replicas=sum(r.state == types_pb2.REPLICA_DROPPED for r in plan.replicas),
        suspended_pins=suspended_pins(plan),
    )


def override_view(o: types_pb2.JobOverride | None) -> s.JobOverrideView | None:
    if o is None:
        return None
    pins = [s.PinView(replica=p.replica, tp_degree=p.tp_degree) for p in o.pins]
    return s.JobOverrideView(job=o.job, pins=pins, policy=o.policy, reason=o.reason, at=o.at, by=o.by)


def job_view(
    spec: types_pb2.JobSpec,
    plan: types_pb2.Plan | None,
    override: types_pb2.JobOverride | None,
    acks: dict[int, types_pb2.Ack],
    goodput: Goodput | None = None,
) -> s.JobView:
    policy = spec.policy or "ntp-pw"
    ack_views = [
        s.AckView(rank=r, generation=a.generation, acked_at=a.acked_at, reshard_seconds=a.reshard_seconds)
        for r, a in sorted(acks.items())
    ]
    current = plan.generation if plan is not None else None
    return s.JobView(
        name=spec.name, base_tp=spec.base_tp, min_tp=spec.min_tp or 1, replicas=len(spec.replicas),
        policy=policy, effective_policy=(override.policy if override and override.policy else policy),
        units=[s.UnitFamilyView(name=u.name, count=u.count) for u in spec.units],
        spare_racks=list(spec.spare_racks), global_batch=spec.global_batch, local_batch=spec.local_batch,
        plan=plan_summary(plan) if plan is not None else None, override=override_view(override),
        acks=ack_views, acked_current=sum(a.generation == current for a in ack_views),
        goodput=s.GoodputView(**dataclasses.asdict(goodput)) if goodput is not None else None,
    )


def event_view(e: types_pb2.Event) -> s.EventView:
    return s.EventView(
        seq=e.seq, at=e.at, kind=e.kind, job=e.job, generation=e.generation, cause=e.cause,
        reasons=list(e.reasons), phases=[s.PhaseView(phase=p.phase, at=p.at) for p in e.phases],
        by=e.by,
    )


def change_view(c) -> s.PlanChangeView:
    """A ``plandiff.PlanChange`` as the API shows it."""
    gpu = s.GpuRefView(node=c.gpu[0], index=c.gpu[1]) if c.gpu is not None else None
    return s.PlanChangeView(kind=c.kind, field=c.field, before=c.before, after=c.after,
                            replica=c.replica, gpu=gpu)
