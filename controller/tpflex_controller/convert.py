"""Conversion at the edge: etcd protobufs <-> the planner's domain types (pure)."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping

from tpflex_proto import types_pb2

from tpflex_controller.planner.model import (
    ClusterState,
    GpuKey,
    GpuStatus,
    JobOverrides,
    JobSpec,
    PlanningError,
    PlanResult,
    Policy,
    RackInfo,
    ReplicaAssignment,
    ReplicaSpec,
    ReplicaState,
    StageAssignment,
    StageSpec,
    SuspendedPin,
)
from tpflex_controller.store import Snapshot

_GPU_STATE = {
    types_pb2.GPU_HEALTHY: GpuStatus.HEALTHY,
    types_pb2.GPU_DEGRADED: GpuStatus.DEGRADED,
    types_pb2.GPU_FAILED: GpuStatus.FAILED,
}
_REPLICA_STATE = {
    ReplicaState.HEALTHY: types_pb2.REPLICA_HEALTHY,
    ReplicaState.DEGRADED: types_pb2.REPLICA_DEGRADED,
    ReplicaState.DROPPED: types_pb2.REPLICA_DROPPED,
    ReplicaState.ON_SPARE: types_pb2.REPLICA_ON_SPARE,
}
_REPLICA_STATE_BACK = {v: k for k, v in _REPLICA_STATE.items()}


def rack_info(rack: types_pb2.Rack, nodes: Mapping[str, types_pb2.Node] | None = None) -> RackInfo:
    """The planner's view of a rack record; with ``nodes`` (the agents' registrations),
    its power limits are the tighter of the record's and what the GPUs report
    (``device_limits``)."""
    # node names interned: the view's live nodes and GPU keys hold the same objects, so
    # the planner's set look-ups compare by identity (no string compares per node)
    names = list(map(sys.intern, rack.nodes))
    gpus = tuple((node, i) for node in names for i in range(rack.gpus_per_node))
    tdp, lo, hi, per_gpu = device_limits(rack, names, nodes)
    return RackInfo(
        name=rack.name,
        domain_size=rack.domain_size or len(gpus),
        power_budget_w=rack.power_budget_w,
        tdp_w=tdp,
        min_w=lo,
        max_w=hi,
        gpus=gpus,
        nodes=tuple(dict.fromkeys(names)),
        gpu_max_w=per_gpu,
    )


def device_limits(
    rack: types_pb2.Rack, names: list[str], nodes: Mapping[str, types_pb2.Node] | None
) -> tuple[float, float, float, dict[GpuKey, float]]:
    """(TDP, min, max, per-GPU max below max) of a rack: the rack record's limits made
    tighter by the limits its GPUs report in their nodes' registrations (GpuDevice
    min/default/max_limit_w, read from NVML by the agent). Per GPU the max is
    min(device max, rack gpu_max_w); the rack's min is the highest min; its TDP (the
    default cap every unboosted GPU gets) the lowest default, at most the rack's
    gpu_tdp_w and at most any GPU's max. A GPU that reports no range (max 0: lost when
    its agent started) or is not registered counts as the rack's ``max`` (the highest
    reported max): when every reported GPU has the same max, the per-GPU map is empty.
    A rack field of 0 is not given (the devices' value stands)."""
    tdp, lo, hi = rack.gpu_tdp_w, rack.gpu_min_w, rack.gpu_max_w
    if not nodes:
        return tdp, lo, hi, {}
    reported: dict[GpuKey, tuple[float, float, float]] = {}
    per_node = rack.gpus_per_node
    for name in dict.fromkeys(names):
        node = nodes.get(name)
        if node is None:
            continue
        for d in node.gpus:
            if d.max_limit_w > 0 and d.index < per_node and _finite(d.min_limit_w, d.default_limit_w, d.max_limit_w):
                reported[(name, d.index)] = (d.min_limit_w, d.default_limit_w, d.max_limit_w)
    if not reported:
        return tdp, lo, hi, {}
    maxes = {g: (min(r[2], hi) if hi > 0 else r[2]) for g, r in reported.items()}
    top = max(maxes.values())
    floor_max = min(maxes.values())
    lo = max(lo, max(r[0] for r in reported.values()))
    defaults = [r[1] for r in reported.values() if r[1] > 0]
    if defaults:
        tdp = min(tdp, min(defaults)) if tdp > 0 else min(defaults)
    tdp = min(tdp, floor_max) if tdp > 0 else floor_max
    per_gpu = {g: m for g, m in maxes.items() if m < top}
    return tdp, min(lo, tdp), top, per_gpu


def _finite(*values: float) -> bool:
    return all(math.isfinite(v) and v >= 0 for v in values)


def cluster_state(snap: Snapshot, racks: dict[str, RackInfo] | None = None) -> ClusterState:
    """The planner's view of a snapshot. ``racks`` may be passed in when the caller caches
    the (rarely changing) rack infos."""
    if racks is None:
        racks = {name: rack_info(r, snap.nodes) for name, r in snap.racks.items()}
    status: dict[GpuKey, GpuStatus] = {}
    speed: dict[GpuKey, float] = {}
    for node, nh in snap.health.items():
        for g in nh.gpus:
            st = _GPU_STATE.get(g.state, GpuStatus.HEALTHY)
            if st is not GpuStatus.HEALTHY:
                status[(node, g.index)] = st
            if 0 < g.relative_speed < 1:
                speed[(node, g.index)] = g.relative_speed
    for key in snap.gpu_holds:  # the leader's flap damping: held GPUs count as failed
        status[key] = GpuStatus.FAILED
    pins: dict[GpuKey, float] = {}
    for key, o in snap.gpu_overrides.items():
        if o.drained and status.get(key) is not GpuStatus.FAILED:
            status[key] = GpuStatus.DRAINED
        if o.power_cap_w > 0:
            pins[key] = o.power_cap_w
    return ClusterState(
        racks=racks,
        gpu_status=status,
        gpu_speed=speed,
        live_nodes=frozenset(snap.nodes),
        power_pins=pins,
    )


def job_spec(spec: types_pb2.JobSpec, racks: dict[str, RackInfo]) -> JobSpec:
    """The planner's view of a job spec; raises PlanningError for a spec that names an
    unknown rack or a stage whose rank count is not the base TP degree."""
    replicas = []
    for r_idx, rep in enumerate(spec.replicas):
        stages = []
        for s_idx, st in enumerate(rep.stages):
            if st.ranks:
                gpus = tuple((g.node, g.index) for g in st.ranks)
            else:
                info = racks.get(st.rack)
                if info is None:
                    raise PlanningError(
                        f"job {spec.name}: replica {r_idx} stage {s_idx} names unknown rack {st.rack!r}"
                    )
                gpus = info.gpus[: spec.base_tp]
            if len(gpus) != spec.base_tp:
                raise PlanningError(
                    f"job {spec.name}: replica {r_idx} stage {s_idx} has {len(gpus)} ranks, "
                    f"base TP degree is {spec.base_tp}"
                )
            stages.append(StageSpec(rack=st.rack, gpus=gpus))
        replicas.append(ReplicaSpec(stages=tuple(stages)))
    return JobSpec(
        name=spec.name,
        base_tp=spec.base_tp,
        replicas=tuple(replicas),
        units={u.name: u.count for u in spec.units},
        min_tp=spec.min_tp or 1,
        policy=Policy.parse(spec.policy or Policy.NTP_PW.value),
        spare_racks=tuple(spec.spare_racks),
        local_batch=spec.local_batch or 1,
    )


def job_overrides(o: types_pb2.JobOverride | None) -> JobOverrides:
    if o is None:
        return JobOverrides()
    return JobOverrides(
        pins={p.replica: p.tp_degree for p in o.pins},
        policy=Policy.parse(o.policy) if o.policy else None,
    )


def _gpu_ref(g: GpuKey) -> types_pb2.GpuRef:
    return types_pb2.GpuRef(node=g[0], index=g[1])


def plan_to_proto(result: PlanResult, generation: int, *, cause: str = "", now: float = 0.0) -> types_pb2.Plan:
    plan = types_pb2.Plan(
        job=result.job,
        generation=generation,
        policy=result.policy.value,
        expected_throughput_ratio=result.expected_throughput_ratio,
        reasons=list(result.reasons),
        created_at=now,
        cause=cause,
    )
    for r in result.replicas:
        rp = plan.replicas.add(
            index=r.index,
            state=_REPLICA_STATE[r.state],
            tp_degree=r.tp_degree,
            local_batch=r.local_batch,
            relative_throughput=r.relative_throughput,
            reason=r.reason,
        )
        for s in r.stages:
            rp.stages.add(
                rack=s.rack, tp_degree=s.tp_degree, gpus=[_gpu_ref(g) for g in s.gpus], spec_stage=s.spec_stage
            )
    for gpu in sorted(result.power_caps):
        plan.power_caps.add(gpu=_gpu_ref(gpu), cap_w=result.power_caps[gpu])
    for pin in result.suspended_pins:
        plan.suspended_pins.add(replica=pin.replica, tp_degree=pin.tp_degree, reason=pin.reason)
    return plan


def plan_from_proto(plan: types_pb2.Plan) -> PlanResult:
    replicas = tuple(
        ReplicaAssignment(
            index=r.index,
            state=_REPLICA_STATE_BACK.get(r.state, ReplicaState.HEALTHY),
            stages=tuple(
                StageAssignment(
                    rack=s.rack,
                    tp_degree=s.tp_degree,
                    gpus=tuple((g.node, g.index) for g in s.gpus),
                    spec_stage=s.spec_stage,
                )
                for s in r.stages
            ),
            tp_degree=r.tp_degree,
            local_batch=r.local_batch,
            relative_throughput=r.relative_throughput,
            reason=r.reason,
        )
        for r in plan.replicas
    )
    return PlanResult(
        job=plan.job,
        policy=Policy.parse(plan.policy or Policy.NTP_PW.value),
        replicas=replicas,
        power_caps={(c.gpu.node, c.gpu.index): c.cap_w for c in plan.power_caps},
        expected_throughput_ratio=plan.expected_throughput_ratio,
        reasons=tuple(plan.reasons),
        suspended_pins=tuple(
            SuspendedPin(p.replica, p.tp_degree, p.reason) for p in plan.suspended_pins
        ),
    )
