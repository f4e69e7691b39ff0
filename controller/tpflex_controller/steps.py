"""Per-job step reports in a bounded in-memory window: achieved samples/s (goodput)."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from tpflex_proto import controller_pb2


@dataclass(frozen=True, slots=True)
class StepSample:
    step: int
    samples: int
    seconds: float
    at: float


@dataclass(frozen=True, slots=True)
class Goodput:
    """A job's achieved throughput against its failure-free expectation.

    ``achieved`` is wall-clock samples/s over each replica's recent steps (a replica that
    stopped reporting — dropped, or its rank dead — counts 0); ``failure_free`` is the
    number of replicas that ever reported times the mean wall-clock rate a replica showed
    while it ran at the base TP degree. Pauses (re-planning, resharding) lower
    ``achieved`` because the rate is measured between report timestamps."""

    achieved_samples_per_s: float
    failure_free_samples_per_s: float | None
    ratio: float | None
    replicas_reporting: int
    replicas_seen: int


def wallclock_rate(window) -> float:
    """Samples per second between the first and the last report of ``window``."""
    if len(window) < 2:
        return 0.0
    ordered = sorted(window, key=lambda s: s.at)
    span = ordered[-1].at - ordered[0].at
    return sum(s.samples for s in ordered[1:]) / span if span > 0 else 0.0


class StepStats:
    """Thread-safe. Reports of one (job, replica, step) from several ranks count once."""

    def __init__(self, window: int = 64, max_jobs: int = 1024) -> None:
        self._window = window
        self._max_jobs = max_jobs
        self._lock = threading.Lock()
        self._jobs: dict[str, dict[int, deque[StepSample]]] = {}
        # per job and replica: recent steps run at the base TP degree (failure-free rate)
        self._healthy: dict[str, dict[int, deque[StepSample]]] = {}

    def known(self, job: str) -> bool:
        with self._lock:
            return job in self._jobs

    def record(self, r: controller_pb2.StepReport) -> bool:
        """Add a report; False when its (replica, step) was already counted."""
        with self._lock:
            replicas = self._jobs.get(r.job)
            if replicas is None:
                if len(self._jobs) >= self._max_jobs:
                    evicted = next(iter(self._jobs))
                    self._jobs.pop(evicted)
                    self._healthy.pop(evicted, None)
                replicas = self._jobs[r.job] = {}
            window = replicas.setdefault(r.replica, deque(maxlen=self._window))
            if any(s.step == r.step for s in window):
                return False
            sample = StepSample(r.step, r.samples, r.step_seconds, r.at)
            window.append(sample)
            if r.base_tp and r.tp_degree == r.base_tp:
                healthy = self._healthy.setdefault(r.job, {})
                healthy.setdefault(r.replica, deque(maxlen=4 * self._window)).append(sample)
            return True

    def goodput(self, job: str, stale_after_s: float = 10.0) -> Goodput | None:
        """None when the job has no reports here (see Goodput for the definitions)."""
        with self._lock:
            replicas = self._jobs.get(job)
            if not replicas:
                return None
            newest = max(w[-1].at for w in replicas.values() if w)
            live = [w for w in replicas.values() if w and w[-1].at >= newest - stale_after_s]
            achieved = sum(wallclock_rate(w) for w in live)
            healthy = [wallclock_rate(w) for w in self._healthy.get(job, {}).values() if len(w) > 1]
        expected = len(replicas) * sum(healthy) / len(healthy) if healthy else None
        return Goodput(
            achieved_samples_per_s=achieved,
            failure_free_samples_per_s=expected,
            ratio=achieved / expected if expected else None,
            replicas_reporting=len(live),
            replicas_seen=len(replicas),
        )

    def achieved_samples_per_second(self, job: str) -> float | None:
        """Sum over replicas of (samples / seconds) over each replica's window; None when
        the job has no reports."""
        with self._lock:
            replicas = self._jobs.get(job)
            if not replicas:
                return None
            total = 0.0
            for window in replicas.values():
                seconds = sum(s.seconds for s in window)
                if seconds > 0:
                    total += sum(s.samples for s in window) / seconds
            return total

    def jobs(self) -> list[str]:
        with self._lock:
            return list(self._jobs)

    def forget(self, job: str) -> None:
        with self._lock:
            self._jobs.pop(job, None)
            self._healthy.pop(job, None)


class GoodputCollector:
    """Prometheus collector reading the step window at scrape time:
    ``tpflex_job_achieved_samples_per_second{training_job}``."""

    def __init__(self, steps: StepStats) -> None:
        self.steps = steps

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(
            "tpflex_job_achieved_samples_per_second",
            "Samples per second the job achieved over its recent step reports",
            labels=["training_job"],
        )
        ratio = GaugeMetricFamily(
            "tpflex_job_goodput_ratio",
            "Achieved wall-clock samples/s over the failure-free expectation (see docs/metrics.md)",
            labels=["training_job"],
        )
        for job in sorted(self.steps.jobs()):
            rate = self.steps.achieved_samples_per_second(job)
            if rate is not None:
                family.add_metric([job], rate)
            goodput = self.steps.goodput(job)
            if goodput is not None and goodput.ratio is not None:
                ratio.add_metric([job], goodput.ratio)
        yield family
        yield ratio
