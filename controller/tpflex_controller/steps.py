"""Per-job step reports in a bounded in-memory window: achieved samples/s (goodput)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
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

    ``achieved`` is samples/s over each replica's recent steps, summed over the replicas
    still reporting: per replica, samples between the first and last report of its window
    over the time between them (this controller's receive times, not the trainer's), and
    never more than its samples over its reported step time (a replica cannot run faster
    than its steps). A replica that stopped reporting for ``stale_after_s`` (dropped, its
    rank dead) counts 0; a job whose reports all stopped achieves 0. ``failure_free`` is
    the number of replicas that ever reported times the mean rate a replica showed while
    it ran at the failure-free TP degree T (the base degree, or the smallest unit count
    when that is lower). ``ratio`` = achieved / failure_free, clamped to [0, 1]
    (a window can run faster than the mean by noise; the expectation is an upper bound).
    Pauses (re-planning, resharding) lower ``achieved``."""

    achieved_samples_per_s: float
    failure_free_samples_per_s: float | None
    ratio: float | None
    replicas_reporting: int
    replicas_seen: int


def wallclock_rate(window) -> float:
    """Samples per second between the first and the last report of ``window``, at most
    the samples over the reported step time."""
    if len(window) < 2:
        return 0.0
    ordered = sorted(window, key=lambda s: s.at)
    span = ordered[-1].at - ordered[0].at
    wall = sum(s.samples for s in ordered[1:]) / span if span > 0 else 0.0
    busy = sum(s.seconds for s in ordered[1:])
    return min(wall, sum(s.samples for s in ordered[1:]) / busy) if busy > 0 else 0.0


class StepStats:
    """Thread-safe. Reports of one (job, replica, step) from several ranks count once.
    ``clock``: the time a report is received and goodput is read at (wall clock)."""

    def __init__(self, window: int = 64, max_jobs: int = 1024, stale_after_s: float = 10.0,
                 clock: Callable[[], float] = time.time) -> None:
        self._window = window
        self._max_jobs = max_jobs
        self._stale_after_s = stale_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._jobs: dict[str, dict[int, deque[StepSample]]] = {}
        # per job and replica: recent steps run at the base TP degree (failure-free rate)
        self._healthy: dict[str, dict[int, deque[StepSample]]] = {}

    def known(self, job: str) -> bool:
        with self._lock:
            return job in self._jobs

    def record(self, r: controller_pb2.StepReport, at: float | None = None, full_tp: int = 0) -> bool:
        """Add a (checked) report received at ``at`` (default: the clock); False when its
        (replica, step) was already counted. ``full_tp``: the job's failure-free degree T
        when its unit counts cap it below ``base_tp`` (0: T is the report's base_tp)."""
        at = self._clock() if at is None else at
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
            sample = StepSample(r.step, r.samples, r.step_seconds, at)
            window.append(sample)
            if r.base_tp and r.tp_degree == (full_tp or r.base_tp):
                healthy = self._healthy.setdefault(r.job, {})
                healthy.setdefault(r.replica, deque(maxlen=4 * self._window)).append(sample)
            return True

    def goodput(self, job: str) -> Goodput | None:
        """None when the job has no reports here (see Goodput for the definitions)."""
        now = self._clock()
        with self._lock:
            replicas = self._jobs.get(job)
            if not replicas:
                return None
            live = [w for w in replicas.values() if w and w[-1].at >= now - self._stale_after_s]
            achieved = sum(wallclock_rate(w) for w in live)
            healthy = [wallclock_rate(w) for w in self._healthy.get(job, {}).values() if len(w) > 1]
            seen = len(replicas)
        healthy = [h for h in healthy if h > 0]
        expected = seen * sum(healthy) / len(healthy) if healthy else None
        return Goodput(
            achieved_samples_per_s=achieved,
            failure_free_samples_per_s=expected,
            ratio=min(1.0, achieved / expected) if expected else None,
            replicas_reporting=len(live),
            replicas_seen=seen,
        )

    def achieved_samples_per_second(self, job: str) -> float | None:
        """The achieved rate of :meth:`goodput` (what REST shows); None without reports."""
        g = self.goodput(job)
        return g.achieved_samples_per_s if g is not None else None

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
            "Samples per second the job achieved over its recent step reports (0 once they stop)",
            labels=["training_job"],
        )
        ratio = GaugeMetricFamily(
            "tpflex_job_goodput_ratio",
            "Achieved over failure-free samples/s, in [0, 1] (see docs/metrics.md)",
            labels=["training_job"],
        )
        for job in sorted(self.steps.jobs()):
            goodput = self.steps.goodput(job)  # one reading: the same figures as REST
            if goodput is None:
                continue
            family.add_metric([job], goodput.achieved_samples_per_s)
            if goodput.ratio is not None:
                ratio.add_metric([job], goodput.ratio)
        yield family
        yield ratio
