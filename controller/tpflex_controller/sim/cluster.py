"""The simulated cluster as the planner sees it, and one planner evaluation of a failure
state (pure).

GPUs are numbered 0..N-1; GPU g is local rank g % T of domain g // T. Domains
0..R*P-1 hold the job's replicas, the last ``spares`` domains are spares. Only replicas
with a failed GPU are handed to the production planner (as one job, in replica order,
with every spare rack), because a replica without one always gets the identity plan and
the planner decides replicas independently except for the spare pool, which it hands out
in replica order; the result equals planning the whole job.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from tpflex_proto.powermodel import DEFAULT_POWER_MODEL, PowerModel

from tpflex_controller.planner import (
    ClusterState,
    GpuKey,
    GpuStatus,
    JobSpec,
    Policy,
    RackInfo,
    ReplicaSpec,
    ReplicaState,
    StageSpec,
    plan,
)
from tpflex_controller.sim.config import ClusterConfig, Placement


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What one failure state costs under one policy and placement."""

    throughput_ratio: float  # job samples/s vs failure-free
    dropped_replicas: int
    degraded_domains: int  # job domains with a failed GPU
    boosted_gpus: int
    power_ratio: float  # power of working GPUs vs all job GPUs at TDP
    boost_w: float  # watts above TDP spent on boosts
    spares_needed: int  # spare domains needed now to keep a fixed global batch
    paused: bool  # the fixed global batch cannot be met with the configured spares
    planner_calls: int


class SimCluster:
    """Racks and stage specs built once per configuration; ``evaluate`` plans a state."""

    def __init__(self, cfg: ClusterConfig, model: PowerModel = DEFAULT_POWER_MODEL) -> None:
        self.cfg = cfg.validate()
        self.model = model
        t = cfg.domain_size
        self.racks: dict[str, RackInfo] = {}
        self.stages: list[StageSpec] = []
        self.keys: list[GpuKey] = []
        for d in range(cfg.domains):
            name = f"d{d}"
            gpus = tuple((f"{name}n{j // cfg.gpus_per_node}", j % cfg.gpus_per_node) for j in range(t))
            budget = t * cfg.tdp_w * (1 + cfg.rack_headroom)
            self.racks[name] = RackInfo(name, t, budget, cfg.tdp_w, cfg.tdp_w / 2, cfg.max_w, gpus)
            self.stages.append(StageSpec(name, gpus))
            self.keys.extend(gpus)
        self.job_domains = cfg.replicas * cfg.pp
        self.spare_names = tuple(f"d{d}" for d in range(self.job_domains, cfg.domains))
        self._units = {"heads": cfg.heads}

    def domain_of(self, gpu: int) -> int:
        return gpu // self.cfg.domain_size

    def node_gpus(self, gpu: int) -> range:
        n = self.cfg.gpus_per_node
        start = gpu - gpu % n
        return range(start, start + n)

    def domain_gpus(self, gpu: int) -> range:
        t = self.cfg.domain_size
        start = gpu - gpu % t
        return range(start, start + t)

    def failed_by_domain(self, failed: Iterable[int]) -> dict[int, int]:
        counts: dict[int, int] = {}
        t = self.cfg.domain_size
        for g in failed:
            counts[g // t] = counts.get(g // t, 0) + 1
        return counts

    def affected_replicas(self, by_domain: dict[int, int], placement: Placement) -> list[list[int]]:
        """The replicas (as domain lists, stage order) that hold a degraded job domain."""
        p = self.cfg.pp
        degraded = [d for d in by_domain if d < self.job_domains]
        if placement is Placement.UNPACKED:
            replicas = sorted({d // p for d in degraded})
            return [list(range(r * p, (r + 1) * p)) for r in replicas]
        degraded.sort(key=lambda d: (-by_domain[d], d))
        healthy = (d for d in range(self.job_domains) if d not in by_domain)
        groups = [degraded[i : i + p] for i in range(0, len(degraded), p)]
        if groups and len(groups[-1]) < p:
            groups[-1].extend(next(healthy) for _ in range(p - len(groups[-1])))
        return groups

    def evaluate(
        self, failed: Iterable[int], policy: Policy, placement: Placement, spares_available: int
    ) -> Snapshot:
        failed = list(failed)
        by_domain = self.failed_by_domain(failed)
        groups = self.affected_replicas(by_domain, placement)
        cfg = self.cfg
        if not groups:
            return Snapshot(1.0, 0, 0, 0, 1.0, 0.0, 0, False, 0)
        job = JobSpec(
            name="sim",
            base_tp=cfg.domain_size,
            replicas=tuple(ReplicaSpec(tuple(self.stages[d] for d in g)) for g in groups),
            units=self._units,
            min_tp=cfg.effective_min_tp,
            spare_racks=self.spare_names if policy is Policy.SPARE else (),
        )
        status = dict.fromkeys((self.keys[g] for g in failed), GpuStatus.FAILED)
        result = plan(ClusterState(self.racks, status), job, policy=policy, power_model=self.model)
        return self._snapshot(result.replicas, result.power_caps, groups, by_domain, policy, spares_available)

    def _snapshot(self, replicas, caps, groups, by_domain, policy, spares_available) -> Snapshot:
        cfg = self.cfg
        rel_sum = sum(r.relative_throughput for r in replicas)
        capacity = cfg.replicas - len(replicas) + rel_sum
        dropped = sum(r.state is ReplicaState.DROPPED for r in replicas)
        used = sum(s.tp_degree for r in replicas for s in r.stages)
        working = (cfg.replicas - len(replicas)) * cfg.replica_gpus + used
        boost_w = sum(caps.values()) - len(caps) * cfg.tdp_w
        power_ratio = (working * cfg.tdp_w + boost_w) / (cfg.replicas * cfg.replica_gpus * cfg.tdp_w)
        deficit = cfg.replicas - capacity
        short = [g for g, r in zip(groups, replicas, strict=True) if r.relative_throughput < 1 - 1e-9]
        short_domains = sum(1 for g in short for d in g if d in by_domain)
        need = 0 if deficit <= 1e-9 else min(short_domains, cfg.pp * math.ceil(deficit - 1e-9))
        if policy is Policy.SPARE:  # spares the planner already placed count as needed
            spare = set(self.spare_names)
            need += sum(1 for r in replicas for s in r.stages if s.rack in spare)
        paused = deficit > 1e-9 if policy is Policy.SPARE else need > spares_available
        return Snapshot(
            throughput_ratio=capacity / cfg.replicas,
            dropped_replicas=dropped,
            degraded_domains=sum(1 for d in by_domain if d < self.job_domains),
            boosted_gpus=len(caps),
            power_ratio=power_ratio,
            boost_w=boost_w,
            spares_needed=need,
            paused=paused,
            planner_calls=1,
        )
