"""Goodput accounting: achieved wall-clock throughput vs the failure-free expectation."""

from __future__ import annotations

import pytest
from tpflex_controller.api import views
from tpflex_controller.steps import StepStats
from tpflex_proto import controller_pb2, types_pb2


def report(replica: int, step: int, at: float, samples: int = 4, tp: int = 4, base: int = 4):
    return controller_pb2.StepReport(
        job="j", rank=replica * base, replica=replica, step=step, samples=samples,
        step_seconds=0.05, at=at, tp_degree=tp, base_tp=base,
    )


def test_healthy_job_runs_at_its_failure_free_rate():
    steps = StepStats()
    for i in range(11):
        for r in (0, 1):
            steps.record(report(r, i, at=i * 0.1))
    g = steps.goodput("j")
    assert g.achieved_samples_per_s == pytest.approx(2 * 40 / 1.0)
    assert g.failure_free_samples_per_s == pytest.approx(80.0)
    assert g.ratio == pytest.approx(1.0)
    assert (g.replicas_reporting, g.replicas_seen) == (2, 2)


def test_degraded_replica_with_smaller_batch_lowers_the_ratio():
    steps = StepStats(window=8)
    for i in range(11):  # healthy phase: both replicas 4 samples / 0.1 s
        for r in (0, 1):
            steps.record(report(r, i, at=i * 0.1))
    for i in range(11, 30):  # replica 1 at TP 3 with 3 samples per step
        steps.record(report(0, i, at=i * 0.1))
        steps.record(report(1, i, at=i * 0.1, samples=3, tp=3))
    g = steps.goodput("j")
    assert g.failure_free_samples_per_s == pytest.approx(80.0)  # only TP-4 steps count
    assert g.achieved_samples_per_s == pytest.approx(40.0 + 30.0)
    assert g.ratio == pytest.approx(70 / 80)


def test_a_replica_that_stopped_reporting_counts_zero():
    steps = StepStats()
    for i in range(11):
        steps.record(report(0, i, at=i * 0.1))
        steps.record(report(1, i, at=i * 0.1))
    for i in range(11, 300):  # replica 1 dropped: no more reports
        steps.record(report(0, i, at=i * 0.1))
    g = steps.goodput("j", stale_after_s=10.0)
    assert g.replicas_reporting == 1 and g.replicas_seen == 2
    assert g.ratio == pytest.approx(0.5)


def test_no_reports_no_goodput_and_no_healthy_steps_no_ratio():
    steps = StepStats()
    assert steps.goodput("j") is None
    for i in range(5):
        steps.record(report(0, i, at=i * 0.1, tp=3))
    g = steps.goodput("j")
    assert g.achieved_samples_per_s > 0 and g.failure_free_samples_per_s is None and g.ratio is None


def test_job_view_carries_goodput():
    steps = StepStats()
    for i in range(3):
        steps.record(report(0, i, at=i * 0.5))
    spec = types_pb2.JobSpec(name="j", base_tp=4)
    view = views.job_view(spec, None, None, {}, steps.goodput("j"))
    assert view.goodput.achieved_samples_per_s == pytest.approx(8.0)
    assert views.job_view(spec, None, None, {}).goodput is None
