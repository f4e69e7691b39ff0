"""Loss vs failed fraction (static snapshots) and the closed forms it must agree with (pure).

Every point averages ``samples`` independent failure states in which each GPU is failed
with probability f. The same failure states are planned under every policy and placement
(common random numbers), so differences between policies are not sampling noise.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

from tpflex_controller.planner import Policy
from tpflex_controller.sim.cluster import SimCluster
from tpflex_controller.sim.config import Placement, SweepConfig
from tpflex_controller.sim.trace import sample_failed


@dataclass(frozen=True)
class SweepRow:
    domain_size: int
    pp: int
    gpus: int
    replicas: int
    policy: str
    placement: str
    failed_fraction: float
    samples: int
    loss_mean: float
    loss_sem: float  # standard error of the mean
    closed_form: float | None  # the closed form, where one applies

    def as_dict(self) -> dict:
        return asdict(self)


def dp_drop_unpacked(f: float, replica_gpus: int) -> float:
    return 1.0 - (1.0 - f) ** replica_gpus


def dp_drop_packed(f: float, domain_size: int) -> float:
    return 1.0 - (1.0 - f) ** domain_size


def ntp_unpacked(f: float, replica_gpus: int, domain_size: int) -> float:
    return replica_gpus / domain_size * f


def closed_form(policy: Policy, placement: Placement, f: float, t: int, pp: int) -> float | None:
    if policy is Policy.DP_DROP:
        if placement is Placement.UNPACKED:
            return dp_drop_unpacked(f, t * pp)
        return dp_drop_packed(f, t)
    if policy is Policy.NTP and placement is Placement.UNPACKED:
        return ntp_unpacked(f, t * pp, t)
    return None


def sample_losses(
    sim: SimCluster,
    fraction: float,
    samples: int,
    seed: str,
    policies: tuple[Policy, ...],
    placements: tuple[Placement, ...],
) -> dict[tuple[Policy, Placement], list[float]]:
    """Loss of each (policy, placement) on ``samples`` shared failure states."""
    out: dict[tuple[Policy, Placement], list[float]] = {
        (p, pl): [] for p in policies for pl in placements
    }
    spares = sim.cfg.spares
    for k in range(samples):
        rng = random.Random(f"{seed}/{fraction}/{k}")
        failed = sample_failed(sim.cfg.gpus, fraction, rng)
        for (policy, placement), losses in out.items():
            snap = sim.evaluate(failed, policy, placement, spares)
            losses.append(1.0 - snap.throughput_ratio)
    return out


def run_sweep(cfg: SweepConfig, progress: Callable[[float], None] | None = None) -> list[SweepRow]:
    cfg = cfg.validate()
    rows: list[SweepRow] = []
    total = len(cfg.domain_sizes) * len(cfg.fractions)
    done = 0
    for t in cfg.domain_sizes:
        sim = SimCluster(cfg.cluster(t))
        for f in cfg.fractions:
            losses = sample_losses(sim, f, cfg.samples, f"{cfg.seed}/{t}", cfg.policies, cfg.placements)
            for (policy, placement), values in losses.items():
                rows.append(_row(sim, policy, placement, f, values))
            done += 1
            if progress is not None:
                progress(done / total)
    return rows


def _row(sim: SimCluster, policy: Policy, placement: Placement, f: float, values: list[float]) -> SweepRow:
    c = sim.cfg
    sem = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return SweepRow(
        domain_size=c.domain_size,
        pp=c.pp,
        gpus=c.gpus,
        replicas=c.replicas,
        policy=policy.value,
        placement=placement.value,
        failed_fraction=f,
        samples=len(values),
        loss_mean=statistics.fmean(values),
        loss_sem=sem,
        closed_form=closed_form(policy, placement, f, c.domain_size, c.pp),
    )
