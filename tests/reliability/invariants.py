"""The invariant oracle of the hostile-input tests and of bench/abuse.py: what must hold
of a running fleet whatever it was sent (checked from the outside: etcd, the agents'
gRPC, the controller's REST and /metrics).

Each ``*_violations`` function returns a list of human-readable violations (empty = ok);
``check_all`` waits for the ones that hold "within one reconcile" and asserts."""

from __future__ import annotations

import math
import time

import grpc
import httpx
from google.protobuf.descriptor import FieldDescriptor
from tpflex_proto import agent_pb2, agent_pb2_grpc, codec, keys, planstore, types_pb2

# physical bound of a served achieved rate: replicas x local batch / trainer.min_step_seconds
MIN_STEP_SECONDS = 1e-3
TOLERANCE_W = 1.0

_TYPES = (
    (keys.RACKS, types_pb2.Rack), (keys.NODES, types_pb2.Node), (keys.HEALTH, types_pb2.NodeHealth),
    (keys.GPU_OVERRIDES, types_pb2.GpuOverride), (keys.JOB_OVERRIDES, types_pb2.JobOverride),
    (keys.POWER, types_pb2.NodePowerPlan), (keys.EVENTS, types_pb2.Event),
)
_JOB_TYPES = {keys.Kind.JOB_SPEC: types_pb2.JobSpec, keys.Kind.JOB_PLAN: types_pb2.Plan,
              keys.Kind.JOB_HISTORY: types_pb2.Plan, keys.Kind.JOB_ASSIGN: types_pb2.Plan,
              keys.Kind.JOB_ACK: types_pb2.Ack}


def _type_of(key: str):
    if key == keys.LEADER:
        return types_pb2.LeaderRecord
    for prefix, cls in _TYPES:
        if key.startswith(prefix):
            return cls
    k = keys.parse(key)
    return _JOB_TYPES.get(k.kind) if k is not None else None


def _nonfinite(msg, path: str = "") -> list[str]:
    out = []
    for field, value in msg.ListFields():
        where = f"{path}.{field.name}"
        values = value if field.is_repeated else [value]
        for v in values:
            if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
                if not math.isfinite(v):
                    out.append(f"{where}={v!r}")
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                out += _nonfinite(v, where)
    return out


def stored_nonfinite(etcd) -> list[str]:
    """Every NaN/inf float stored under /tpflex/v1/ (values that decode)."""
    kvs, _ = etcd.get_prefix(keys.PREFIX)
    out = []
    for kv in kvs:
        cls = _type_of(kv.key)
        if cls is None:
            continue
        try:
            msg = codec.decode(cls, kv.value, kv.key)
        except codec.MalformedValue:
            continue
        out += [f"{kv.key}: {v}" for v in _nonfinite(msg)]
    return out


def _desired(etcd, node: str) -> dict[int, float] | None:
    kv = etcd.get(keys.power(node))
    if kv is None:
        return None
    plan = codec.decode(types_pb2.NodePowerPlan, kv.value, kv.key)
    return {c.gpu.index: c.cap_w for c in plan.caps}


def cap_violations(etcd, agents: dict[str, str]) -> list[str]:
    """``agents``: node -> gRPC address. Limits outside the device's range, or away from
    etcd's desired cap (the device default when the node has no desired caps)."""
    out = []
    for node, address in sorted(agents.items()):
        with grpc.insecure_channel(address) as ch:
            resp = agent_pb2_grpc.AgentStub(ch).GetDevices(agent_pb2.GetDevicesRequest(), timeout=5)
        desired = _desired(etcd, node) or {}
        lost = {h.index for h in resp.health.gpus if h.state == types_pb2.GPU_FAILED}
        for g in resp.gpus:
            if g.index in lost:
                continue  # a GPU off the bus has no limit to read or set
            if not g.min_limit_w - TOLERANCE_W <= g.power_limit_w <= g.max_limit_w + TOLERANCE_W:
                out.append(f"{node}:{g.index} limit {g.power_limit_w} outside [{g.min_limit_w}, {g.max_limit_w}]")
            want = desired.get(g.index, g.default_limit_w)
            if abs(g.power_limit_w - want) > TOLERANCE_W:
                out.append(f"{node}:{g.index} limit {g.power_limit_w} W, desired {want} W")
    return out


def plan_violations(etcd) -> list[str]:
    """Plans using a failed GPU, a GPU of a node without a live registration, a drained GPU,
    or a GPU another plan (or the same plan twice) uses."""
    kvs, _ = etcd.get_prefix(keys.PREFIX)
    failed, drained, live, plans = set(), set(), set(), {}
    for kv in kvs:
        if kv.key.startswith(keys.HEALTH):
            h = codec.decode(types_pb2.NodeHealth, kv.value, kv.key)
            failed |= {(h.node, g.index) for g in h.gpus if g.state == types_pb2.GPU_FAILED}
        elif kv.key.startswith(keys.NODES):
            live.add(kv.key[len(keys.NODES):])
        elif kv.key.startswith(keys.GPU_OVERRIDES):
            o = codec.decode(types_pb2.GpuOverride, kv.value, kv.key)
            if o.drained:
                drained.add((o.gpu.node, o.gpu.index))
    plans = planstore.whole_plans(kvs)[0]  # the stored headers and parts, assembled
    out, owner = [], {}
    for job, plan in sorted(plans.items()):
        for rep in plan.replicas:
            for st in rep.stages:
                for g in st.gpus:
                    gpu = (g.node, g.index)
                    if gpu in failed or gpu in drained or g.node not in live:
                        out.append(f"job {job} gen {plan.generation} uses unusable GPU {gpu}")
                    if gpu in owner:
                        out.append(f"GPU {gpu} used by job {owner[gpu]} and job {job}")
                    owner[gpu] = job
    return out


def served_violations(rest_url: str) -> list[str]:
    """REST and /metrics figures that are not finite or outside their physical bounds."""
    out = []
    for job in httpx.get(f"{rest_url}/v1/jobs", timeout=10).json():
        plan = job.get("plan") or {}
        ratio = plan.get("expected_throughput_ratio")
        if ratio is not None and not 0.0 <= ratio <= 1.0:
            out.append(f"job {job['name']}: expected_throughput_ratio {ratio}")
        g = job.get("goodput")
        if g is not None:
            bound = job["replicas"] * max(job["local_batch"], 1) / MIN_STEP_SECONDS
            rate = g["achieved_samples_per_s"]
            if not (isinstance(rate, float | int) and 0 <= rate <= bound):
                out.append(f"job {job['name']}: achieved {rate} outside [0, {bound}]")
            if g["ratio"] is not None and not 0.0 <= g["ratio"] <= 1.0:
                out.append(f"job {job['name']}: goodput ratio {g['ratio']}")
            if g["replicas_seen"] > job["replicas"]:
                out.append(f"job {job['name']}: replicas_seen {g['replicas_seen']} > {job['replicas']}")
    for line in httpx.get(f"{rest_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("tpflex_"):
            value = float(line.rsplit(" ", 1)[1])
            if not math.isfinite(value):
                out.append(f"metric {line}")
            if line.startswith("tpflex_job_goodput_ratio") and not 0.0 <= value <= 1.0:
                out.append(f"metric {line}")
    return out


def settle(check, timeout: float) -> list[str]:
    """Poll ``check`` until it finds nothing or the timeout; the last violations."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def check_all(fleet, ctl, reconcile_s: float = 5.0) -> None:
    """Assert every invariant; the caps and the plans may take one reconcile to converge."""
    agents = {n: a.grpc_address for n, a in fleet.agents.items()}
    assert not (v := settle(lambda: plan_violations(fleet.etcd), reconcile_s)), v
    assert not (v := settle(lambda: cap_violations(fleet.etcd, agents), reconcile_s)), v
    assert not (v := stored_nonfinite(fleet.etcd)), v
    assert not (v := served_violations(ctl.rest_url)), v
