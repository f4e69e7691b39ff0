"""Goodput accounting: achieved wall-clock throughput vs the failure-free expectation
(pure: a synthetic clock stands for the receive times)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from tpflex_controller.api import views
from tpflex_controller.steps import GoodputCollector, StepStats
from tpflex_proto import controller_pb2, types_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def report(replica: int, step: int, samples: int = 4, tp: int = 4, base: int = 4, seconds: float = 0.05):
    return controller_pb2.StepReport(
        job="j", rank=replica * base, replica=replica, step=step, samples=samples,
        step_seconds=seconds, tp_degree=tp, base_tp=base,
    )


def stats(**kw) -> tuple[StepStats, Clock]:
    clock = Clock()
    return StepStats(clock=clock, **kw), clock


def feed(steps: StepStats, clock: Clock, replica: int, step: int, at: float, full_tp: int = 0, **kw) -> None:
    clock.now = at
    steps.record(report(replica, step, **kw), full_tp=full_tp)


def test_healthy_job_runs_at_its_failure_free_rate():
    steps, clock = stats()
    for i in range(11):
        for r in (0, 1):
            feed(steps, clock, r, i, at=i * 0.1)
    g = steps.goodput("j")
    assert g.achieved_samples_per_s == pytest.approx(2 * 40 / 1.0)
    assert g.failure_free_samples_per_s == pytest.approx(80.0)
    assert g.ratio == pytest.approx(1.0)
    assert (g.replicas_reporting, g.replicas_seen) == (2, 2)


def test_failure_free_rate_counts_steps_at_the_unit_capped_degree():
    """3 heads on 4-GPU stages: a failure-free replica runs at TP 3 (its 4th GPU is a
    spare), and those steps, not none, make the failure-free rate."""
    steps, clock = stats()
    for i in range(11):
        for r in (0, 1):
            feed(steps, clock, r, i, at=i * 0.1, tp=3, full_tp=3)
    g = steps.goodput("j")
    assert g.failure_free_samples_per_s == pytest.approx(80.0)
    assert g.ratio == pytest.approx(1.0)
    steps, clock = stats()
    for i in range(11):  # without the job's T, TP-3 steps are not failure-free ones
        feed(steps, clock, 0, i, at=i * 0.1, tp=3)
    assert steps.goodput("j").failure_free_samples_per_s is None


def test_degraded_replica_with_smaller_batch_lowers_the_ratio():
    steps, clock = stats(window=8)
    for i in range(11):  # healthy phase: both replicas 4 samples / 0.1 s
        for r in (0, 1):
            feed(steps, clock, r, i, at=i * 0.1)
    for i in range(11, 30):  # replica 1 at TP 3 with 3 samples per step
        feed(steps, clock, 0, i, at=i * 0.1)
        feed(steps, clock, 1, i, at=i * 0.1, samples=3, tp=3)
    g = steps.goodput("j")
    assert g.failure_free_samples_per_s == pytest.approx(80.0)  # only TP-4 steps count
    assert g.achieved_samples_per_s == pytest.approx(40.0 + 30.0)
    assert g.ratio == pytest.approx(70 / 80)


def test_a_replica_that_stopped_reporting_counts_zero_and_a_silent_job_zero():
    steps, clock = stats(stale_after_s=10.0)
    for i in range(11):
        feed(steps, clock, 0, i, at=i * 0.1)
        feed(steps, clock, 1, i, at=i * 0.1)
    for i in range(11, 300):  # replica 1 dropped: no more reports
        feed(steps, clock, 0, i, at=i * 0.1)
    g = steps.goodput("j")
    assert g.replicas_reporting == 1 and g.replicas_seen == 2
    assert g.ratio == pytest.approx(0.5)
    clock.now += 10.5  # every report stopped: the throughput expires
    g = steps.goodput("j")
    assert g.achieved_samples_per_s == 0.0 and g.replicas_reporting == 0 and g.ratio == 0.0


def test_no_reports_no_goodput_and_no_healthy_steps_no_ratio():
    steps, clock = stats()
    assert steps.goodput("j") is None
    for i in range(5):
        feed(steps, clock, 0, i, at=i * 0.1, tp=3)
    g = steps.goodput("j")
    assert g.achieved_samples_per_s > 0 and g.failure_free_samples_per_s is None and g.ratio is None


def test_a_replica_cannot_run_faster_than_its_steps_and_the_ratio_stays_within_1():
    steps, clock = stats()
    for i in range(11):  # failure-free: 4 samples every 0.1 s
        feed(steps, clock, 0, i, at=i * 0.1)
    for i in range(11, 75):  # a burst of reports 1 ms apart, each claiming a 50 ms step
        feed(steps, clock, 0, i, at=1.0 + (i - 10) * 0.001)
    g = steps.goodput("j")
    assert g.achieved_samples_per_s <= 4 / 0.05 + 1e-9  # the compute bound of its steps
    assert 0.0 <= g.ratio <= 1.0


def test_rest_and_the_metric_give_the_same_achieved_rate():
    steps, clock = stats()
    for i in range(20):
        feed(steps, clock, 0, i, at=i * 0.3, seconds=0.1)  # wall 0.3 s, compute 0.1 s per step
    registry = CollectorRegistry()
    registry.register(GoodputCollector(steps))
    metric = registry.get_sample_value("tpflex_job_achieved_samples_per_second", {"training_job": "j"})
    rest = views.job_view(types_pb2.JobSpec(name="j", base_tp=4), None, None, {}, steps.goodput("j"))
    assert metric == pytest.approx(rest.goodput.achieved_samples_per_s) == pytest.approx(4 / 0.3)
    assert registry.get_sample_value("tpflex_job_goodput_ratio", {"training_job": "j"}) == pytest.approx(1.0)


def test_job_view_carries_goodput():
    steps, clock = stats()
    for i in range(3):
        feed(steps, clock, 0, i, at=i * 0.5)
    spec = types_pb2.JobSpec(name="j", base_tp=4)
    view = views.job_view(spec, None, None, {}, steps.goodput("j"))
    assert view.goodput.achieved_samples_per_s == pytest.approx(8.0)
    assert views.job_view(spec, None, None, {}).goodput is None


def test_the_rest_child_asks_the_controller_for_goodput_once_per_ttl():
    """The REST process's link (api/link.py, a real socket pair): one round trip for every
    job, kept goodput_ttl_s, so job reads do not queue on the controller."""
    import socket

    from tpflex_controller.api.link import LinkClient, LinkServer

    steps, clock = stats()
    for i in range(11):
        feed(steps, clock, 0, i, at=i * 0.1)
    ours, theirs = socket.socketpair()
    server = LinkServer(theirs, CollectorRegistry(), steps)
    link_clock = Clock()
    client = LinkClient(ours, goodput_ttl_s=1.0, clock=link_clock)
    try:
        first = client.goodput("j")
        assert first == steps.goodput("j") and client.goodput("other") is None
        feed(steps, clock, 1, 11, at=1.1)  # a second replica reports: the controller knows more
        assert steps.goodput("j").replicas_seen == 2
        link_clock.now = 0.9
        assert client.goodput("j") == first  # within the TTL: kept, no round trip
        assert client.refreshes == 1
        link_clock.now = 1.0
        # after the TTL: answered with what is kept, the refresh runs on its own thread
        with client._lock:  # the link busy (a metrics scrape): the read still answers at once
            assert client.goodput("j") == first
            assert client.goodput("j") == first and client.refreshes == 1  # one refresh in flight
        assert client.wait_refreshes(2, 10)
        second = client.goodput("j")
        assert second == steps.goodput("j") != first
        assert client.refreshes == 2
        feed(steps, clock, 0, 12, at=1.2)
        link_clock.now = 3.0  # a quiet spell of two TTLs: this read waits for the answer
        assert client.goodput("j") == steps.goodput("j") != second and client.refreshes == 3
    finally:
        server.close()
        ours.close()
