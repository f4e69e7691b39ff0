"""The controller's metrics follow the decisions; label sets are pre-created at zero; the
exposition passes promtool's lint."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from tpflex_controller.cache import ClusterView
from tpflex_controller.metrics import CAUSES, PHASES, RANK_FAILURE_KINDS, ControllerMetrics
from tpflex_proto import codec, keys, types_pb2

from tests.controller.controller_harness import (
    controller_on_job,
    eventually,
    fail_gpu,
)


def test_metrics_follow_a_gpu_failure(etcd_server, etcd):
    with controller_on_job(etcd_server, etcd) as (_, watcher, ctl):
        value = ctl.registry.get_sample_value
        watcher.wait_generation(1)
        for cause in CAUSES:  # pre-created at zero
            assert value("tpflex_reconfigurations_total", {"training_job": "job1", "cause": cause}) is not None
        fail_gpu(etcd, "rack1-n00", 2, {1})
        plan = watcher.wait_generation(2)
        assert value("tpflex_controller_is_leader") == 1.0
        # the loop updates metrics right after its commit, which the watcher may see first
        eventually(lambda: value("tpflex_reconfiguration_seconds_count", {"phase": "committed"}) == 2.0)
        assert value("tpflex_plan_generation", {"training_job": "job1"}) == 2.0
        assert value("tpflex_replica_tp_degree", {"training_job": "job1", "replica": "1"}) == 3.0
        assert value("tpflex_replica_tp_degree", {"training_job": "job1", "replica": "0"}) == 4.0
        # the racks' gauges are set when the loop is idle after the commit
        eventually(lambda: value("tpflex_rack_healthy_gpus", {"rack": "rack1"}) == 3.0)
        assert value("tpflex_rack_healthy_gpus", {"rack": "rack0"}) == 4.0
        assert value("tpflex_job_expected_throughput_ratio", {"training_job": "job1"}) == pytest.approx(
            plan.expected_throughput_ratio
        )
        assert value("tpflex_reconfigurations_total", {"training_job": "job1", "cause": "gpu_failed"}) == 1.0
        assert value("tpflex_reconfigurations_total", {"training_job": "job1", "cause": "drain"}) == 0.0
        boosted = {(c.gpu.node, c.gpu.index): c.cap_w for c in plan.power_caps}
        # the cap gauges of a commit are set when the loop is next idle (off the decision)
        eventually(lambda: value("tpflex_gpu_power_cap_watts", {"node": "rack1-n01", "gpu": "0"})
                   == boosted[("rack1-n01", 0)])
        assert value("tpflex_rack_domain_size", {"rack": "rack1"}) == 4.0
        for kind in RANK_FAILURE_KINDS:  # pre-created at zero: an alert's rate sees a first failure
            assert value("tpflex_rank_failures_total", {"training_job": "job1", "kind": kind}) == 0.0
    assert value("tpflex_controller_is_leader") == 0.0


def _ack(etcd, rank: int, generation: int) -> None:
    etcd.put(keys.job_ack("job1", rank), codec.encode(types_pb2.Ack(job="job1", rank=rank, generation=generation)))


def test_acked_generation_follows_the_acks_of_the_plans_ranks(etcd_server, etcd):
    """tpflex_plan_acked_generation on a real etcd: 0 before acks, the generation once every
    rank acked it, and after a failure the new generation once as many ranks as the new
    plan runs (7: one GPU failed) acked it."""
    with controller_on_job(etcd_server, etcd) as (_, watcher, ctl):
        value = ctl.registry.get_sample_value
        acked = lambda: value("tpflex_plan_acked_generation", {"training_job": "job1"})  # noqa: E731
        plan = watcher.wait_generation(1)
        assert sum(len(st.gpus) for rep in plan.replicas for st in rep.stages) == 8
        eventually(lambda: value("tpflex_plan_generation", {"training_job": "job1"}) == 1.0)
        assert acked() == 0.0
        for rank in range(8):
            _ack(etcd, rank, 1)
        eventually(lambda: acked() == 1.0)
        fail_gpu(etcd, "rack1-n00", 2, {1})
        watcher.wait_generation(2)
        eventually(lambda: value("tpflex_plan_generation", {"training_job": "job1"}) == 2.0)
        assert acked() == 1.0  # generation 2 committed, not acked: the alert's condition
        for rank in (0, 1, 2, 3, 4, 6, 7):  # rank 5 ran on the failed GPU
            _ack(etcd, rank, 2)
        eventually(lambda: acked() == 2.0)


def _fold_ack(view: ClusterView, rank: int, generation: int | None) -> None:
    key = keys.job_ack("j", rank)
    if generation is None:
        view.fold("delete", key, b"", 0)
    else:
        view.fold("put", key, codec.encode(types_pb2.Ack(job="j", rank=rank, generation=generation)), 0)


def test_acked_generation_counts_ranks_by_their_latest_ack():
    """ClusterView.acked_generation: the highest generation that ``ranks`` ranks have
    reached (each rank's latest ack), never above the plan's; 0 while too few acked."""
    view = ClusterView()
    assert view.acked_generation("j", 3, 1) == 0
    assert view.acked_generation("j", 0, 4) == 4  # a plan without ranks has nothing to wait for
    for rank in range(3):
        _fold_ack(view, rank, 1)
    assert view.acked_generation("j", 4, 1) == 0  # 3 of 4 ranks
    assert view.acked_generation("j", 3, 1) == 1
    _fold_ack(view, 0, 2)
    _fold_ack(view, 1, 2)
    assert view.acked_generation("j", 3, 2) == 1  # rank 2 still runs generation 1
    assert view.acked_generation("j", 2, 2) == 2
    _fold_ack(view, 2, 3)  # a rank that skipped generation 2
    assert view.acked_generation("j", 3, 3) == 2
    assert view.acked_generation("j", 3, 2) == 2
    assert view.acked_generation("j", 1, 2) == 2  # never above the current plan's generation
    _fold_ack(view, 2, 3)  # the same ack again counts once
    assert view.acked_generation("j", 3, 3) == 2
    _fold_ack(view, 0, None)  # a deleted ack counts no more
    assert view.acked_generation("j", 3, 3) == 0
    assert view.acked_generation("j", 2, 3) == 2
    assert view.acked_generation("other", 1, 1) == 0


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_exposition_passes_promtool_lint():
    registry = CollectorRegistry()
    m = ControllerMetrics(registry)
    m.job_seen("j", 2)
    m.plan_observed("j", 3, 0.97, [(0, 4), (1, 3)])
    m.power_observed("n0", [(0, 1100.0)])
    for phase in PHASES:
        m.phase(phase, 0.2)
    out = subprocess.run(["promtool", "check", "metrics"], input=generate_latest(registry),
                         capture_output=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr


def test_no_series_has_a_label_named_job():
    """Prometheus owns ``job`` (the scrape target): the training job is ``training_job``,
    so the scrape config needs no honor_labels."""
    from prometheus_client.parser import text_string_to_metric_families
    from tpflex_controller.steps import GoodputCollector, StepStats

    registry = CollectorRegistry()
    m = ControllerMetrics(registry)
    steps = StepStats()
    registry.register(GoodputCollector(steps))
    m.job_seen("j", 2)
    m.plan_observed("j", 3, 0.97, [(0, 4), (1, 3)])
    m.reconfigurations.labels(training_job="j", cause="drain").inc()
    samples = [s for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples]
    assert {s.labels.get("training_job") for s in samples if s.name.startswith("tpflex_plan_generation")} == {"j"}
    assert not [s for s in samples if "job" in s.labels]


def test_cap_series_are_written_without_holding_a_sample_per_gpu():
    """4,000 nodes' caps (16,000 series; the load bench has 40,000): the exposition has
    each GPU's last cap, a later partial plan of a node updating its GPUs and keeping the
    others (compared with a dict kept here), and writing it allocates at its peak less
    than 5x the text it returns. Before, the family held a ``Sample`` and a label dict
    per GPU: a peak of ~9x the text (~20 MB a scrape at 10,000 nodes)."""
    import random
    import tracemalloc

    from prometheus_client.parser import text_string_to_metric_families

    rng = random.Random(7)
    m = ControllerMetrics(CollectorRegistry())
    expected: dict[tuple[str, str], float] = {}
    for n in range(4000):
        caps = [(i, float(rng.randrange(300, 1200))) for i in range(4)]
        m.power_observed(f"r{n // 18:04d}-n{n % 18:02d}", caps)
        expected.update({(f"r{n // 18:04d}-n{n % 18:02d}", str(i)): c for i, c in caps})
    for n in rng.sample(range(4000), 500):  # a second plan for some nodes, for 2 GPUs
        caps = [(i, float(rng.randrange(300, 1200))) for i in (1, 3)]
        m.power_observed(f"r{n // 18:04d}-n{n % 18:02d}", caps)
        expected.update({(f"r{n // 18:04d}-n{n % 18:02d}", str(i)): c for i, c in caps})
    generate_latest(m.registry)  # first-call caches (escaping, formatting) out of the peak
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        text = generate_latest(m.registry)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    [caps] = [f for f in text_string_to_metric_families(text.decode()) if f.name == "tpflex_gpu_power_cap_watts"]
    got = {(s.labels["node"], s.labels["gpu"]): s.value for s in caps.samples}
    assert got == expected
    assert peak < 5 * len(text), (peak, len(text))
