"""The simulated cluster as the planner sees it, and one planner evaluation of a failure
state (pure).

GPUs are numbered 0..N-1; GPU g is local rank g % T of domain g // T. Domains
0..R*P-1 hold the job's replicas, the last ``spares`` domains are spares. Only replicas
with a failed GPU are handed to the production planner (as one job, in replica order,
with every spare rack), because a replica without one always gets the identity plan and
the planner decides replicas independently except for the spare pool, which it hands out
in replica order; the result equals planning the whole job (a test checks it). Outside the
spare policy, outcomes are memoised per replica failure pattern, so a replay re-plans only
the replicas an event changed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace

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
class ReplicaOutcome:
    """What the planner decided for one affected replica, reduced to what costs count."""

    rel: float
    dropped: bool
    used_gpus: int
    boosted_gpus: int
    boost_w: float
    on_spare: int  # stages placed on spare domains


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
            self.racks[name] = RackInfo(name, t, budget, cfg.tdp_w, cfg.tdp_w / 2, cfg.domain_max_w(d), gpus)
            self.stages.append(StageSpec(name, gpus))
            self.keys.extend(gpus)
        self.job_domains = cfg.replicas * cfg.pp
        self.spare_names = tuple(f"d{d}" for d in range(self.job_domains, cfg.domains))
        self._units = {"heads": cfg.heads}
        self._memo: dict[tuple, ReplicaOutcome] = {}
        self.plan_seconds = 0.0  # time spent inside the planner (for planner calls/s)

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
        if not groups:
            return Snapshot(1.0, 0, 0, 0, 1.0, 0.0, 0, False, 0)
        outcomes, calls = self._outcomes(groups, failed, policy)
        snap = self._snapshot(outcomes, groups, by_domain, policy, spares_available)
        return replace(snap, planner_calls=calls)

    def _outcomes(
        self, groups: list[list[int]], failed: list[int], policy: Policy
    ) -> tuple[list[ReplicaOutcome], int]:
        """Outcome per affected replica. Outside the spare policy a replica's plan depends
        only on its own domains' failures, so outcomes are memoised on those and only the
        replicas whose failures changed are handed to the planner (one call)."""
        t = self.cfg.domain_size
        by_dom: dict[int, list[int]] = {}
        for g in failed:
            by_dom.setdefault(g // t, []).append(g)
        keys = [(policy, tuple(g), tuple(x for d in g for x in sorted(by_dom.get(d, ())))) for g in groups]
        cacheable = policy is not Policy.SPARE
        missing = [i for i, k in enumerate(keys) if not cacheable or k not in self._memo]
        if missing:
            planned = self._plan([groups[i] for i in missing], failed, policy)
            if len(self._memo) > 200_000:
                self._memo.clear()
            fresh = dict(zip(missing, planned, strict=True))
            if cacheable:
                self._memo.update((keys[i], o) for i, o in fresh.items())
        else:
            fresh = {}
        outcomes = [fresh[i] if i in fresh else self._memo[k] for i, k in enumerate(keys)]
        return outcomes, 1 if missing else 0

    def _plan(self, groups: list[list[int]], failed: list[int], policy: Policy) -> list[ReplicaOutcome]:
        cfg = self.cfg
        job = JobSpec(
            name="sim",
            base_tp=cfg.domain_size,
            replicas=tuple(ReplicaSpec(tuple(self.stages[d] for d in g)) for g in groups),
            units=self._units,
            min_tp=cfg.effective_min_tp,
            spare_racks=self.spare_names if policy is Policy.SPARE else (),
        )
        status = dict.fromkeys((self.keys[g] for g in failed), GpuStatus.FAILED)
        started = time.perf_counter()
        result = plan(ClusterState(self.racks, status), job, policy=policy, power_model=self.model)
        self.plan_seconds += time.perf_counter() - started
        caps = result.power_caps
        as_dict = getattr(caps, "as_dict", None)  # a plan's MergedCaps: one walk, then a dict
        caps = as_dict() if as_dict is not None else caps
        spare = set(self.spare_names)
        out = []
        for r in result.replicas:
            used = [g for s in r.stages for g in s.gpus]
            boosted = [caps[g] for g in used if g in caps]
            out.append(
                ReplicaOutcome(
                    rel=r.relative_throughput,
                    dropped=r.state is ReplicaState.DROPPED,
                    used_gpus=len(used),
                    boosted_gpus=len(boosted),
                    boost_w=sum(boosted) - len(boosted) * cfg.tdp_w,
                    on_spare=sum(1 for s in r.stages if s.rack in spare),
                )
            )
        return out

    def _snapshot(self, outcomes, groups, by_domain, policy, spares_available) -> Snapshot:
        cfg = self.cfg
        capacity = cfg.replicas - len(outcomes) + sum(o.rel for o in outcomes)
        used = sum(o.used_gpus for o in outcomes)
        working = (cfg.replicas - len(outcomes)) * cfg.replica_gpus + used
        boost_w = sum(o.boost_w for o in outcomes)
        power_ratio = (working * cfg.tdp_w + boost_w) / (cfg.replicas * cfg.replica_gpus * cfg.tdp_w)
        deficit = cfg.replicas - capacity
        short = [g for g, o in zip(groups, outcomes, strict=True) if o.rel < 1 - 1e-9]
        short_domains = sum(1 for g in short for d in g if d in by_domain)
        need = 0 if deficit <= 1e-9 else min(short_domains, cfg.pp * math.ceil(deficit - 1e-9))
        need += sum(o.on_spare for o in outcomes)  # spares the planner placed count as needed
        paused = deficit > 1e-9 if policy is Policy.SPARE else need > spares_available
        return Snapshot(
            throughput_ratio=capacity / cfg.replicas,
            dropped_replicas=sum(o.dropped for o in outcomes),
            degraded_domains=sum(1 for d in by_domain if d < self.job_domains),
            boosted_gpus=sum(o.boosted_gpus for o in outcomes),
            power_ratio=power_ratio,
            boost_w=boost_w,
            spares_needed=need,
            paused=paused,
            planner_calls=1,
        )
