"""Synthetic clusters and jobs (protobufs as stored in etcd), for tests, benchmarks and the
demo: NVL72-like racks of ``nodes_per_rack`` nodes x ``gpus_per_node`` GPUs."""

from __future__ import annotations

import time

from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.etcd import Etcd, Op


def rack(
    name: str,
    nodes_per_rack: int = 18,
    gpus_per_node: int = 4,
    *,
    tdp_w: float = 1000.0,
    min_w: float = 400.0,
    max_w: float = 1300.0,
    budget_factor: float = 1.0,
) -> types_pb2.Rack:
    gpus = nodes_per_rack * gpus_per_node
    return types_pb2.Rack(
        name=name,
        domain_size=gpus,
        power_budget_w=gpus * tdp_w * budget_factor,
        gpu_tdp_w=tdp_w,
        gpu_min_w=min_w,
        gpu_max_w=max_w,
        nodes=[f"{name}-n{i:02d}" for i in range(nodes_per_rack)],
        gpus_per_node=gpus_per_node,
    )


def node(name: str, rack_name: str, gpus: int = 4, agent_address: str = "", tdp_w: float = 1000.0) -> types_pb2.Node:
    return types_pb2.Node(
        name=name,
        rack=rack_name,
        agent_address=agent_address,
        backend="sim",
        registered_at=time.time(),
        gpus=[
            types_pb2.GpuDevice(
                index=i, uuid=f"GPU-{name}-{i}", name="sim", power_limit_w=tdp_w, default_limit_w=tdp_w
            )
            for i in range(gpus)
        ],
    )


def job(
    name: str,
    rack_names: list[str],
    base_tp: int,
    *,
    policy: str = "ntp-pw",
    min_tp: int = 1,
    local_batch: int = 8,
    units: dict[str, int] | None = None,
) -> types_pb2.JobSpec:
    units = units or {"heads": 64, "ffn": 256, "vocab": 128}
    return types_pb2.JobSpec(
        name=name,
        base_tp=base_tp,
        replicas=[types_pb2.ReplicaSpec(stages=[types_pb2.StageSpec(rack=r)]) for r in rack_names],
        units=[types_pb2.UnitFamily(name=k, count=v, bytes_per_unit=1 << 20) for k, v in units.items()],
        min_tp=min_tp,
        policy=policy,
        global_batch=local_batch * len(rack_names),
        local_batch=local_batch,
        created_at=time.time(),
    )


def failed_health(node_name: str, gpus: int, failed: set[int], seq: int = 1) -> types_pb2.NodeHealth:
    now = time.time()
    return types_pb2.NodeHealth(
        node=node_name,
        updated_at=now,
        seq=seq,
        gpus=[
            types_pb2.GpuHealth(
                index=i,
                state=types_pb2.GPU_FAILED if i in failed else types_pb2.GPU_HEALTHY,
                reason="xid 79: GPU has fallen off the bus" if i in failed else "",
                xids=[79] if i in failed else [],
                relative_speed=1.0,
                updated_at=now,
            )
            for i in range(gpus)
        ],
    )


def store_cluster(
    etcd: Etcd,
    racks: list[types_pb2.Rack],
    *,
    lease: int = 0,
    agent_addresses: dict[str, str] | None = None,
    batch: int = 128,  # etcd --max-txn-ops default
) -> None:
    """Write the racks and register every node of them (bound to ``lease`` if given)."""
    addresses = agent_addresses or {}
    ops = []
    for r in racks:
        ops.append(Op.put(keys.rack(r.name), codec.encode(r)))
        for n in r.nodes:
            reg = node(n, r.name, r.gpus_per_node, addresses.get(n, ""), r.gpu_tdp_w)
            ops.append(Op.put(keys.node(n), codec.encode(reg), lease=lease))
    for i in range(0, len(ops), batch):
        etcd.txn([], ops[i : i + batch])
