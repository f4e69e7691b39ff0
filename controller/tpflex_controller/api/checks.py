"""Pure checks of operator requests against the current state; each failure is an
``ApiError`` (422) whose message says why the request is impossible."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tpflex_controller.api.errors import ApiError, invalid
from tpflex_controller.planner.model import ClusterState, GpuKey, JobSpec


def usable_gpus(job: JobSpec, replica: int, state: ClusterState) -> tuple[int, str]:
    """The replica's usable GPUs (min over its stages) and the rack of that stage."""
    best = None
    for stage in job.replicas[replica].stages:
        n = sum(state.usable(g) for g in stage.gpus)
        if best is None or n < best[0]:
            best = (n, stage.rack)
    return best or (0, "")


def check_pin(job: JobSpec, replica: int, degree: int, state: ClusterState) -> None:
    if not 0 <= replica < len(job.replicas):
        raise invalid(
            f"job {job.name!r} has {len(job.replicas)} replicas (0..{len(job.replicas) - 1}); "
            f"replica {replica} does not exist"
        )
    if degree < 1:
        raise invalid(f"replica {replica}: TP degree {degree} is impossible; it must be at least 1")
    if degree > job.base_tp:
        raise invalid(
            f"replica {replica}: TP degree {degree} is above the job's base TP degree {job.base_tp}"
        )
    if degree < job.min_tp:
        raise invalid(
            f"replica {replica}: TP degree {degree} is below the job's min_tp {job.min_tp} "
            "(the shards would not fit in memory)"
        )
    if job.units:
        family, count = min(job.units.items(), key=lambda kv: kv[1])
        if degree > count:
            raise invalid(
                f"replica {replica}: TP degree {degree} would leave a rank with no units: "
                f"weight family {family!r} has only {count} units"
            )
    usable, rack = usable_gpus(job, replica, state)
    if degree > usable:
        raise invalid(
            f"replica {replica}: TP degree {degree} is above its {usable} usable GPUs "
            f"(stage on rack {rack!r})"
        )


def check_pins(job: JobSpec, pins: Iterable[tuple[int, int]], state: ClusterState) -> dict[int, int]:
    out: dict[int, int] = {}
    for replica, degree in pins:
        if replica in out:
            raise invalid(f"replica {replica} is pinned more than once in one request")
        check_pin(job, replica, degree, state)
        out[replica] = degree
    return out


def check_gpus_exist(gpus: Iterable[GpuKey], known: Mapping[GpuKey, str]) -> list[GpuKey]:
    out = []
    for gpu in gpus:
        if gpu not in known:
            raise unknown_gpu(gpu, known)
        if gpu not in out:
            out.append(gpu)
    return out


def unknown_gpu(gpu: GpuKey, known: Mapping[GpuKey, str]) -> ApiError:
    on_node = sorted(i for n, i in known if n == gpu[0])
    if not on_node:
        return invalid(f"GPU {gpu[0]}:{gpu[1]} does not exist: no node {gpu[0]!r} is known")
    return invalid(
        f"GPU {gpu[0]}:{gpu[1]} does not exist: node {gpu[0]!r} has GPUs {on_node[0]}..{on_node[-1]}"
    )
