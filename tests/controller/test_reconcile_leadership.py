"""A leader that loses its lease while a failure is still being handled (its commit timed
out: an etcd leader was killed) keeps the change and its cause: when it (or another
controller) leads again, the plan says gpu_failed, not resync, and the detection time is
the failure's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from tpflex_controller.metrics import ControllerMetrics
from tpflex_controller.reconcile import Reconciler


def test_deposed_leader_keeps_pending_causes(etcd):
    r = Reconciler(etcd, ControllerMetrics(CollectorRegistry()))  # its loop is not started
    r._mark("job1", "gpu_failed", 100.0)
    pending = r._queue.get("job1")
    pending.attempts, pending.not_before = 3, 1e12  # its commits were failing
    r._handle("deposed", "lease lost", 101.0)
    r._handle("elected", object(), 103.0)
    r._mark("job1", "resync", 103.0)  # what a new term marks for every job
    d = r._queue.get("job1")
    assert (d.cause, d.detected_at, d.attempts, d.not_before) == ("gpu_failed", 100.0, 0, 0.0)
