"""The controller's Prometheus metrics (documented in docs/metrics.md).

One :class:`ControllerMetrics` per process, built on an injected registry. Label sets that
are bounded and known (a job's replicas, the racks, the causes of a job) are pre-created at
zero when the job or rack first appears.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Sample

# why a job was re-planned (the ``cause`` label of tpflex_reconfigurations_total)
CAUSES = (
    "gpu_failed",
    "gpu_degraded",
    "gpu_recovered",
    "node_lost",
    "node_joined",
    "drain",
    "undrain",
    "power_pin",
    "override",
    "job_spec",
    "rack_changed",
    "resync",
)
# the ``phase`` label of tpflex_reconfiguration_seconds: time from detection to ...
PHASES = ("committed", "power_applied", "acked")

# the ``kind`` label of tpflex_rank_failures_total (liveness.Outcome kinds that restart groups)
RANK_FAILURE_KINDS = ("soft", "hard", "hang")

# the ``result`` label of tpflex_reconcile_total (workqueue.Result)
RECONCILE_RESULTS = ("ok", "conflict", "etcd_error", "unplannable", "error")

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ControllerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.replica_tp_degree = Gauge(
            "tpflex_replica_tp_degree",
            "Planned TP degree of a job's replica (0 = dropped)",
            ["training_job", "replica"],
            registry=registry,
        )
        self.rack_healthy_gpus = Gauge(
            "tpflex_rack_healthy_gpus",
            "GPUs of a rack that are usable (healthy or degraded, node live, not drained)",
            ["rack"],
            registry=registry,
        )
        # one series per GPU with a power plan (40,000 at 10,000 nodes): a collector that
        # reads a dict at scrape time, not a Gauge child per GPU (~550 B each, created
        # one rack at a time as failures first touch it: the controller's RSS grew with it)
        self.gpu_power_cap_watts = _CapCollector()
        registry.register(self.gpu_power_cap_watts)
        self.plan_generation = Gauge(
            "tpflex_plan_generation", "Current plan generation of a job", ["training_job"], registry=registry
        )
        self.plan_acked_generation = Gauge(
            "tpflex_plan_acked_generation",
            "Highest plan generation of the job that as many ranks as its current plan runs have"
            " acked (0 until then); below tpflex_plan_generation while a rollout waits for acks",
            ["training_job"],
            registry=registry,
        )
        self.rack_domain_size = Gauge(
            "tpflex_rack_domain_size",
            "GPUs in the rack's NVLink domain (racks/<rack> domain_size)",
            ["rack"],
            registry=registry,
        )
        self.reconfigurations = Counter(
            "tpflex_reconfigurations_total",
            "Plan generations committed by this controller, by cause",
            ["training_job", "cause"],
            registry=registry,
        )
        self.reconfiguration_seconds = Histogram(
            "tpflex_reconfiguration_seconds",
            "Time from detecting a change to each phase of the reconfiguration",
            ["phase"],
            buckets=_BUCKETS,
            registry=registry,
        )
        self.expected_throughput_ratio = Gauge(
            "tpflex_job_expected_throughput_ratio",
            "Planned job throughput vs the failure-free job",
            ["training_job"],
            registry=registry,
        )
        self.reconcile_total = Counter(
            "tpflex_reconcile_total",
            "Reconciles of a job by the leader, by result (the work queue's outcome table)",
            ["result"],
            registry=registry,
        )
        for result in RECONCILE_RESULTS:
            self.reconcile_total.labels(result=result)
        self.is_leader = Gauge(
            "tpflex_controller_is_leader",
            "1 while this controller process is the elected leader",
            registry=registry,
        )
        self.agent_push_failures = Counter(
            "tpflex_agent_push_failures_total",
            "Failed attempts to send a power plan to an agent (retried with backoff)",
            registry=registry,
        )
        self.suspended_pins = Gauge(
            "tpflex_job_suspended_pins",
            "Operator TP pins of the job that cannot hold now (a failed or drained GPU, a changed"
            " spec): the current plan ignores them",
            ["training_job"],
            registry=registry,
        )
        self.rank_failures = Counter(
            "tpflex_rank_failures_total",
            "Rank failures that restarted a job's process groups, by kind: soft (a rank died or"
            " stopped beating, GPU kept), hard (repeated soft failures of one GPU: drained), hang"
            " (a rank's watchdog found a collective stuck)",
            ["training_job", "kind"],
            registry=registry,
        )
        self.unplannable_jobs = Gauge(
            "tpflex_unplannable_jobs",
            "Jobs whose spec or overrides cannot be planned right now",
            registry=registry,
        )
        for phase in PHASES:
            self.reconfiguration_seconds.labels(phase=phase)
        self.is_leader.set(0)

    def job_seen(self, job: str, replicas: int) -> None:
        """Pre-create a job's bounded label sets at zero."""
        self.plan_generation.labels(training_job=job)
        self.plan_acked_generation.labels(training_job=job)
        self.expected_throughput_ratio.labels(training_job=job)
        self.suspended_pins.labels(training_job=job)
        for cause in CAUSES:
            self.reconfigurations.labels(training_job=job, cause=cause)
        for kind in RANK_FAILURE_KINDS:
            self.rank_failures.labels(training_job=job, kind=kind)
        for r in range(replicas):
            self.replica_tp_degree.labels(training_job=job, replica=str(r))

    def job_gone(self, job: str, replicas: int) -> None:
        for gauge in (self.plan_generation, self.plan_acked_generation, self.expected_throughput_ratio,
                      self.suspended_pins):
            _remove(gauge, job)
        for cause in CAUSES:
            _remove(self.reconfigurations, job, cause)
        for kind in RANK_FAILURE_KINDS:
            _remove(self.rank_failures, job, kind)
        for r in range(replicas):
            _remove(self.replica_tp_degree, job, str(r))

    def rack_observed(self, rack: str, healthy_gpus: int, domain_size: int) -> None:
        self.rack_healthy_gpus.labels(rack=rack).set(healthy_gpus)
        self.rack_domain_size.labels(rack=rack).set(domain_size)

    def rack_gone(self, rack: str) -> None:
        _remove(self.rack_healthy_gpus, rack)
        _remove(self.rack_domain_size, rack)

    def plan_observed(
        self, job: str, generation: int, ratio: float, degrees: Iterable[tuple[int, int]],
        suspended_pins: int = 0,
    ) -> None:
        self.plan_generation.labels(training_job=job).set(generation)
        self.expected_throughput_ratio.labels(training_job=job).set(ratio)
        self.suspended_pins.labels(training_job=job).set(suspended_pins)
        for replica, degree in degrees:
            self.replica_tp_degree.labels(training_job=job, replica=str(replica)).set(degree)

    def plan_proto_observed(self, job: str, plan) -> None:
        """A stored ``types_pb2.Plan`` (any replica follows the plans in etcd)."""
        degrees = [(r.index, r.tp_degree) for r in plan.replicas]
        self.plan_observed(job, plan.generation, plan.expected_throughput_ratio, degrees,
                           len(plan.suspended_pins))

    def power_observed(self, node: str, caps: Iterable[tuple[int, float]]) -> None:
        self.gpu_power_cap_watts.set(node, caps)

    def phase(self, phase: str, seconds: float) -> None:
        self.reconfiguration_seconds.labels(phase=phase).observe(max(seconds, 0.0))

    def liveness_outcome(self, job: str, outcome) -> None:
        """A liveness decision that restarted the job's groups (``liveness.Outcome``)."""
        if outcome.kind in ("soft", "hard", "hang"):
            self.rank_failures.labels(job, outcome.kind).inc()


class _CapCollector:
    """``tpflex_gpu_power_cap_watts{node,gpu}``: the desired cap of each GPU on a node
    that has a power plan, read at scrape time.

    Its samples are made one at a time while the exposition is written (a family holding
    them all, a ``Sample`` and a label dict per GPU, peaked at ~20 MB for one scrape at
    10,000 nodes, 9x the text it wrote), and a node's row is an immutable tuple replaced
    on change, so the scrape reads a shallow copy of the node table."""

    NAME = "tpflex_gpu_power_cap_watts"
    HELP = "Desired power cap of a GPU on a node that has a power plan"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._caps: dict[str, tuple[tuple[int, float], ...]] = {}

    def set(self, node: str, caps: Iterable[tuple[int, float]]) -> None:
        new = {index: float(cap) for index, cap in caps}
        with self._lock:
            row = dict(self._caps.get(node, ()))
            row.update(new)
            self._caps[node] = tuple(sorted(row.items()))

    def describe(self):
        return [GaugeMetricFamily(self.NAME, self.HELP, labels=["node", "gpu"])]

    def collect(self):
        family = GaugeMetricFamily(self.NAME, self.HELP, labels=["node", "gpu"])
        with self._lock:
            rows = list(self._caps.items())
        family.samples = _LazySamples(self.NAME, rows)
        yield family


class _LazySamples:
    """A family's samples, made as they are iterated (each pass makes them anew)."""

    def __init__(self, name: str, rows: list[tuple[str, tuple[tuple[int, float], ...]]]) -> None:
        self._name, self._rows = name, rows

    def __iter__(self):
        name = self._name
        for node, row in self._rows:
            for index, cap in row:
                yield Sample(name, {"node": node, "gpu": str(index)}, cap, None, None)

    def __len__(self) -> int:
        return sum(len(row) for _, row in self._rows)


def _remove(metric, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass
