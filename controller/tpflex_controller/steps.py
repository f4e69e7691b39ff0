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


class StepStats:
    """Thread-safe. Reports of one (job, replica, step) from several ranks count once."""

    def __init__(self, window: int = 64, max_jobs: int = 1024) -> None:
        self._window = window
        self._max_jobs = max_jobs
        self._lock = threading.Lock()
        self._jobs: dict[str, dict[int, deque[StepSample]]] = {}

    def known(self, job: str) -> bool:
        with self._lock:
            return job in self._jobs

    def record(self, r: controller_pb2.StepReport) -> bool:
        """Add a report; False when its (replica, step) was already counted."""
        with self._lock:
            replicas = self._jobs.get(r.job)
            if replicas is None:
                if len(self._jobs) >= self._max_jobs:
                    self._jobs.pop(next(iter(self._jobs)))
                replicas = self._jobs[r.job] = {}
            window = replicas.setdefault(r.replica, deque(maxlen=self._window))
            if any(s.step == r.step for s in window):
                return False
            window.append(StepSample(r.step, r.samples, r.step_seconds, r.at))
            return True

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


class GoodputCollector:
    """Prometheus collector reading the step window at scrape time:
    ``tpflex_job_achieved_samples_per_second{job}``."""

    def __init__(self, steps: StepStats) -> None:
        self.steps = steps

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(
            "tpflex_job_achieved_samples_per_second",
            "Samples per second the job achieved over its recent step reports",
            labels=["job"],
        )
        for job in sorted(self.steps.jobs()):
            rate = self.steps.achieved_samples_per_second(job)
            if rate is not None:
                family.add_metric([job], rate)
        yield family
