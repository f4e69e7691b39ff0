"""Builders of small clusters and jobs for the planner tests (pure data, no I/O)."""

from __future__ import annotations

from tpflex_controller.planner import (
    ClusterState,
    GpuKey,
    GpuStatus,
    JobSpec,
    RackInfo,
    ReplicaSpec,
    StageSpec,
)

TDP = 700.0
MAX_W = 1000.0


def make_rack(name: str, size: int = 4, gpus_per_node: int = 2, headroom: float = 0.3) -> RackInfo:
    gpus = tuple((f"{name}-n{i // gpus_per_node}", i % gpus_per_node) for i in range(size))
    nodes = tuple(dict.fromkeys(g[0] for g in gpus))
    return RackInfo(name, size, size * TDP * (1 + headroom), TDP, TDP / 2, MAX_W, gpus, nodes)


def make_racks(n: int, size: int = 4, headroom: float = 0.3) -> dict[str, RackInfo]:
    return {f"r{i}": make_rack(f"r{i}", size, headroom=headroom) for i in range(n)}


def make_job(
    racks: dict[str, RackInfo],
    tp: int,
    stages: int = 1,
    *,
    replicas: int | None = None,
    min_tp: int = 1,
    local_batch: int = 8,
    units: dict[str, int] | None = None,
    spares: tuple[str, ...] = (),
) -> JobSpec:
    names = [n for n in racks if n not in spares]
    count = replicas if replicas is not None else len(names) // stages
    reps = tuple(
        ReplicaSpec(
            tuple(
                StageSpec(names[r * stages + s], racks[names[r * stages + s]].gpus[:tp])
                for s in range(stages)
            )
        )
        for r in range(count)
    )
    return JobSpec(
        name="job",
        base_tp=tp,
        replicas=reps,
        units=units if units is not None else {"heads": 64, "ffn": 128},
        min_tp=min_tp,
        local_batch=local_batch,
        spare_racks=spares,
    )


def failed(*gpus: GpuKey, status: GpuStatus = GpuStatus.FAILED) -> dict[GpuKey, GpuStatus]:
    return dict.fromkeys(gpus, status)


def state(racks: dict[str, RackInfo], **kw) -> ClusterState:
    return ClusterState(racks=racks, **kw)
