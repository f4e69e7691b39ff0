"""Simulation settings, their validation and the paper presets (pure)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

from tpflex_controller.planner.model import Policy

# Meta's Llama 3 report: 419 unexpected interruptions in 54 days on 16,384 H100s.
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384
LLAMA3_RATE_PER_GPU_HOUR = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)

# Upper bounds no real study reaches; past them the simulator would run out of memory or
# run for days, so they are refused up front (exit 2 naming the option).
MAX_GPUS = 1 << 20  # 1,048,576 GPUs
MAX_DOMAIN_SIZE = 4096  # GPUs per NVLink domain
MAX_DAYS = 3650.0  # ten years (--days, --warmup-days)
MAX_RATE = 1.0  # failures per GPU-hour
MAX_RATE_SCALE = 1000.0
MAX_DRAWS = 10_000_000  # expected failure draws of a run: rate x scale x GPUs x hours
MAX_SAMPLES = 100_000
MAX_LIST = 1000  # entries of --domain-sizes / --fractions
MIN_FRACTION = 1e-12  # smallest failed fraction > 0 (below it no GPU of any cluster fails)


class SimConfigError(ValueError):
    """A setting is invalid; ``param`` names it (as the CLI spells it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class Blast(enum.StrEnum):
    GPU = "gpu"
    NODE = "node"
    DOMAIN = "domain"


class Placement(enum.StrEnum):
    UNPACKED = "unpacked"  # replica r always uses domains [r*P, (r+1)*P)
    PACKED = "packed"  # on every event, degraded domains packed into the fewest replicas


@dataclass(frozen=True)
class ClusterConfig:
    """The simulated cluster and job. Domain size = the job's base TP degree T."""

    gpus: int = 32_000
    domain_size: int = 32
    pp: int = 8  # pipeline stages (domains) per DP replica
    gpus_per_node: int = 4
    spares: int = 0  # spare domains beyond the job's
    min_tp: int = 0  # 0 = T // 2
    tdp_w: float = 1000.0
    max_w: float = 1300.0
    rack_headroom: float = 0.30  # rack budget = T * TDP * (1 + headroom)
    heads: int = 128  # unit count of the sharded weights (the 480B model's heads)
    # the max power limit the GPUs of each domain report (their default limit is TDP),
    # cycled over the domains: domain d's GPUs report device_max_w[d % len]; the planner
    # takes the tighter of it and ``max_w`` (a domain at TDP has no headroom: its degraded
    # replicas run as plain NTP). () = the GPUs report ``max_w``
    device_max_w: tuple[float, ...] = ()

    def domain_max_w(self, domain: int) -> float:
        """The max limit of domain ``domain``'s GPUs (the tighter of device and rack)."""
        if not self.device_max_w:
            return self.max_w
        return min(self.max_w, self.device_max_w[domain % len(self.device_max_w)])

    @property
    def domains(self) -> int:
        return self.gpus // self.domain_size

    @property
    def replicas(self) -> int:
        return (self.domains - self.spares) // self.pp

    @property
    def replica_gpus(self) -> int:
        return self.pp * self.domain_size

    @property
    def effective_min_tp(self) -> int:
        return self.min_tp or max(1, self.domain_size // 2)

    def validate(self) -> ClusterConfig:
        _positive_int("--gpus", self.gpus, MAX_GPUS)
        _positive_int("--domain-size", self.domain_size, MAX_DOMAIN_SIZE)
        _positive_int("--pp", self.pp)
        _positive_int("--gpus-per-node", self.gpus_per_node)
        if self.gpus % self.domain_size:
            raise SimConfigError("--domain-size", f"{self.domain_size} does not divide --gpus {self.gpus}")
        if self.domain_size % self.gpus_per_node:
            raise SimConfigError(
                "--gpus-per-node", f"{self.gpus_per_node} does not divide --domain-size {self.domain_size}"
            )
        if not 0 <= self.spares < self.domains:
            raise SimConfigError("--spares", f"must be in 0..{self.domains - 1}, got {self.spares}")
        if (self.domains - self.spares) % self.pp:
            raise SimConfigError(
                "--pp", f"{self.pp} does not divide the {self.domains - self.spares} non-spare domains"
            )
        if not 0 <= self.min_tp <= self.domain_size:
            raise SimConfigError("--min-tp", f"must be in 0..{self.domain_size}, got {self.min_tp}")
        _non_negative("--rack-headroom", self.rack_headroom)
        if not 0 < self.tdp_w <= self.max_w:
            raise SimConfigError("--tdp-w", f"must be > 0 and <= the max limit {self.max_w}")
        _device_max("--device-max-w", self.device_max_w, self.tdp_w)
        if self.heads < self.domain_size:
            raise SimConfigError("--heads", f"{self.heads} is fewer than --domain-size {self.domain_size}")
        return self


@dataclass(frozen=True)
class FailureConfig:
    """Failure process: Poisson per working GPU, with a hardware/software split."""

    rate_per_gpu_hour: float = LLAMA3_RATE_PER_GPU_HOUR
    rate_scale: float = 1.0
    hw_fraction: float = 0.78
    hw_repair_days: tuple[float, float] = (3.0, 5.0)  # uniform
    sw_repair_hours: float = 3.0
    blast: Blast = Blast.GPU

    def validate(self) -> FailureConfig:
        _non_negative("--rate", self.rate_per_gpu_hour, MAX_RATE)
        _non_negative("--rate-scale", self.rate_scale, MAX_RATE_SCALE)
        if not 0 <= self.hw_fraction <= 1:
            raise SimConfigError("--hw-fraction", f"must be in [0, 1], got {self.hw_fraction}")
        lo, hi = self.hw_repair_days
        _non_negative("--hw-repair-days", lo)
        _non_negative("--hw-repair-days", hi)
        if hi < lo:
            raise SimConfigError("--hw-repair-days", f"max {hi} is below min {lo}")
        _non_negative("--sw-repair-hours", self.sw_repair_hours)
        return self


@dataclass(frozen=True)
class SimConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    failures: FailureConfig = field(default_factory=FailureConfig)
    days: float = 15.0
    warmup_days: float = 0.0
    policies: tuple[Policy, ...] = tuple(Policy)
    placement: Placement = Placement.UNPACKED
    seed: int = 1

    def validate(self) -> SimConfig:
        self.cluster.validate()
        self.failures.validate()
        _non_negative("--days", self.days, MAX_DAYS)
        _non_negative("--warmup-days", self.warmup_days, MAX_DAYS)
        f = self.failures
        draws = f.rate_per_gpu_hour * f.rate_scale * self.cluster.gpus * 24.0 * (self.days + self.warmup_days)
        if draws > MAX_DRAWS:
            raise SimConfigError(
                "--rate/--rate-scale/--days",
                f"--gpus {self.cluster.gpus} at {f.rate_per_gpu_hour:g} x {f.rate_scale:g} failures per "
                f"GPU-hour over {self.days + self.warmup_days:g} days (with --warmup-days) means about "
                f"{draws:.3g} failure draws, more than the {MAX_DRAWS:,} the simulator takes",
            )
        if not self.policies:
            raise SimConfigError("--policy", "at least one policy is needed")
        return self


@dataclass(frozen=True)
class SweepConfig:
    """Static snapshots: i.i.d. failures at fraction f, many placements averaged."""

    gpus: int = 32_000  # about this many; per domain size the job is R * P * T GPUs
    pp: int = 8
    domain_sizes: tuple[int, ...] = (8, 32, 64, 72)
    fractions: tuple[float, ...] = (0.0005, 0.001, 0.002, 0.003, 0.004, 0.006, 0.008)
    policies: tuple[Policy, ...] = tuple(Policy)
    placements: tuple[Placement, ...] = (Placement.UNPACKED, Placement.PACKED)
    samples: int = 8
    spare_fraction: float = 0.02  # spare domains, as a fraction of the job's domains
    rack_headroom: float = 0.30
    seed: int = 1
    device_max_w: tuple[float, ...] = ()  # ClusterConfig.device_max_w

    def cluster(self, domain_size: int) -> ClusterConfig:
        replicas = max(1, round(self.gpus / (self.pp * domain_size)))
        spares = round(self.spare_fraction * replicas * self.pp)
        gpn = 4 if domain_size % 4 == 0 else 1
        return ClusterConfig(
            gpus=(replicas * self.pp + spares) * domain_size,
            domain_size=domain_size,
            pp=self.pp,
            gpus_per_node=gpn,
            spares=spares,
            rack_headroom=self.rack_headroom,
            heads=max(128, domain_size),
            device_max_w=self.device_max_w,
        ).validate()

    def validate(self) -> SweepConfig:
        _positive_int("--gpus", self.gpus, MAX_GPUS)
        _positive_int("--pp", self.pp)
        _positive_int("--samples", self.samples, MAX_SAMPLES)
        if not 0 < len(self.domain_sizes) <= MAX_LIST:
            raise SimConfigError("--domain-sizes", f"give 1 to {MAX_LIST} sizes, got {len(self.domain_sizes)}")
        if not 0 < len(self.fractions) <= MAX_LIST:
            raise SimConfigError("--fractions", f"give 1 to {MAX_LIST} fractions, got {len(self.fractions)}")
        for t in self.domain_sizes:
            _positive_int("--domain-sizes", t, MAX_DOMAIN_SIZE)
        for f in self.fractions:
            if not (f == 0 or MIN_FRACTION <= f < 1):
                raise SimConfigError("--fractions", f"each must be 0 or in [{MIN_FRACTION:g}, 1), got {f}")
        _non_negative("--rack-headroom", self.rack_headroom)
        _device_max("--device-max-w", self.device_max_w, ClusterConfig.tdp_w)
        if not 0 <= self.spare_fraction < 1:
            raise SimConfigError("--spare-fraction", f"must be in [0, 1), got {self.spare_fraction}")
        if not self.policies:
            raise SimConfigError("--policy", "at least one policy is needed")
        for t in self.domain_sizes:  # the job a domain size gives, with its spares
            replicas = max(1, round(self.gpus / (self.pp * t)))
            job_gpus = (replicas * self.pp + round(self.spare_fraction * replicas * self.pp)) * t
            if job_gpus > MAX_GPUS:
                raise SimConfigError(
                    "--pp/--domain-sizes",
                    f"--pp {self.pp} x TP{t} domains make a {job_gpus}-GPU cluster, more than {MAX_GPUS:,}",
                )
        return self


def _device_max(param: str, values: tuple[float, ...], tdp_w: float) -> None:
    if len(values) > MAX_LIST:
        raise SimConfigError(param, f"give at most {MAX_LIST} limits, got {len(values)}")
    for v in values:
        if not math.isfinite(v) or v < tdp_w:
            raise SimConfigError(param, f"each must be a finite number >= the TDP {tdp_w:g} W, got {v}")


def _positive_int(param: str, value: int, most: int | None = None) -> None:
    if not isinstance(value, int) or value < 1:
        raise SimConfigError(param, f"must be a positive integer, got {value}")
    if most is not None and value > most:
        raise SimConfigError(param, f"must be at most {most:,}, got {value}")


def _non_negative(param: str, value: float, most: float | None = None) -> None:
    if not math.isfinite(value) or value < 0:
        raise SimConfigError(param, f"must be a finite number >= 0, got {value}")
    if most is not None and value > most:
        raise SimConfigError(param, f"must be at most {most:g}, got {value:g}")


# 32,000 job GPUs (125 replicas of PP8 x NVL32) plus 16 spare domains (Fig 7's NTP count)
PAPER_NVL32 = SimConfig(
    cluster=ClusterConfig(gpus=32_512, domain_size=32, pp=8, gpus_per_node=4, spares=16),
    failures=FailureConfig(hw_repair_days=(5.0, 5.0)),  # Fig 7: Llama 3.1 rates, 5-day repair
    days=15.0,
)
PAPER_TP64 = SimConfig(
    cluster=ClusterConfig(gpus=32_000, domain_size=64, pp=1, gpus_per_node=4),
    days=15.0,
    policies=(Policy.DP_DROP, Policy.NTP, Policy.NTP_PW),
)
LLAMA3 = SimConfig(
    cluster=ClusterConfig(gpus=16_384, domain_size=8, pp=16, gpus_per_node=8, tdp_w=700.0, max_w=910.0),
    days=54.0,
)
NVL72 = SimConfig(
    cluster=ClusterConfig(gpus=32_256, domain_size=72, pp=8, gpus_per_node=4, tdp_w=1200.0, max_w=1560.0),
)

PRESETS: dict[str, SimConfig] = {
    "paper-nvl32": PAPER_NVL32,
    "paper-tp64": PAPER_TP64,
    "llama3": LLAMA3,
    "nvl72": NVL72,
}

SWEEP_PRESETS: dict[str, SweepConfig] = {
    "paper": SweepConfig(),
    "paper-nvl32": SweepConfig(domain_sizes=(32,)),
    "paper-tp64": SweepConfig(pp=1, domain_sizes=(64,), fractions=(0.0005, 0.001, 0.002, 0.004)),
    "quick": SweepConfig(gpus=4096, domain_sizes=(8, 32), samples=3, fractions=(0.001, 0.004)),
}


def with_changes(cfg, **changes):
    """``dataclasses.replace`` that skips None values (unset CLI options)."""
    return replace(cfg, **{k: v for k, v in changes.items() if v is not None})
