"""bench/load.py's failure -> commit accounting (issue 35): a failure no plan reflects
within the deadline is a miss (``failures_unreflected``) and counts in the p99 as the
deadline instead of vanishing from it; the planted ``drop-failure`` defect loses one
failure on its way to etcd, in a real etcd."""

from __future__ import annotations

import random

import pytest
from tpflex_controller import convert, synthetic
from tpflex_proto import codec, keys, types_pb2

from bench.load import DecisionChecker, NodeFleet, failure_to_commit, planted

GPU = ("r0-n00", 1)


def _setup():
    racks = [synthetic.rack(f"r{i}", 2, 2) for i in range(2)]
    jobs = {"j": synthetic.job("j", [r.name for r in racks], 4)}
    checker = DecisionChecker(racks, jobs, [n for r in racks for n in r.nodes])
    return racks, checker


def _plan(checker, failed, generation):
    return convert.plan_to_proto(checker.expected("j", failed), generation)


def _judge(checker, events, plans, deadline_s=30.0, **kw):
    return failure_to_commit(events, {"j": plans}, checker.job_racks, checker.node_rack, deadline_s, **kw)


def _fail(rev, t, failed=frozenset({1}), node="r0-n00", gpu=1):
    return (rev, t, node, failed, True, gpu)


def _recover(rev, t, node="r0-n00", gpu=1):
    return (rev, t, node, frozenset(), False, gpu)


def test_a_reflected_failure_is_timed_a_dropped_one_is_a_miss_at_the_deadline():
    _, checker = _setup()
    healthy, failed = _plan(checker, {}, 1), _plan(checker, {"r0-n00": frozenset({1})}, 2)
    assert any(g.node == GPU[0] and g.index == GPU[1] for r in healthy.replicas for s in r.stages for g in s.gpus)
    events = [_fail(10, 100.0)]
    reflected = _judge(checker, events, [(5, 90.0, healthy), (11, 100.05, failed)])
    assert reflected.unreflected == 0 and reflected.superseded == 0
    assert reflected.samples_ms == [pytest.approx(50.0)]
    # the controller never drops the GPU: before, this failure vanished from the samples
    dropped = _judge(checker, events, [(5, 90.0, healthy)])
    assert dropped == (([30_000.0]), 1, 0)
    # a later generation (it reflects another failure) that still uses the GPU does not
    # reflect this one
    still = _plan(checker, {"r1-n01": frozenset({0})}, 2)
    other = _judge(checker, events + [_fail(12, 100.1, frozenset({0}), "r1-n01", 0)],
                   [(5, 90.0, healthy), (13, 100.2, still)])
    assert other.unreflected == 1 and other.samples_ms == [30_000.0, pytest.approx(100.0)]
    # reflected, but after the deadline: a miss at its own latency
    late = _judge(checker, events, [(5, 90.0, healthy), (11, 145.0, failed)], deadline_s=30.0)
    assert late.unreflected == 1 and late.samples_ms == [pytest.approx(45_000.0)]
    with pytest.raises(ValueError, match="deadline_s"):
        _judge(checker, events, [], deadline_s=0.0)


def test_a_failure_recovered_before_any_plan_is_superseded_only_within_the_deadline():
    _, checker = _setup()
    healthy = _plan(checker, {}, 1)
    quick = _judge(checker, [_fail(10, 100.0), _recover(12, 100.5)], [(5, 90.0, healthy)])
    assert quick == ([], 0, 1)
    slow = _judge(checker, [_fail(10, 100.0), _recover(12, 140.0)], [(5, 90.0, healthy)])
    assert slow == ([30_000.0], 1, 0)


def test_a_plan_for_the_gpus_next_failure_does_not_reflect_the_first():
    _, checker = _setup()
    healthy, failed = _plan(checker, {}, 1), _plan(checker, {"r0-n00": frozenset({1})}, 2)
    events = [_fail(10, 100.0), _recover(12, 100.5), _fail(20, 200.0)]
    judged = _judge(checker, events, [(5, 90.0, healthy), (21, 200.01, failed)])
    # the first: recovered in 0.5 s with no plan in between (superseded), not 100 s late
    assert judged.superseded == 1 and judged.unreflected == 0
    assert judged.samples_ms == [pytest.approx(10.0)]


def test_windows_pick_failures_by_write_time_misses_included():
    _, checker = _setup()
    healthy = _plan(checker, {}, 1)
    events = [_fail(10, 100.0)]
    assert _judge(checker, events, [(5, 90.0, healthy)], windows=[(99.0, 101.0)], inside=True).unreflected == 1
    assert _judge(checker, events, [(5, 90.0, healthy)], windows=[(99.0, 101.0)], inside=False) == ([], 0, 0)


def test_a_gpu_the_plan_does_not_use_is_not_judged():
    _, checker = _setup()
    without = _plan(checker, {"r0-n00": frozenset({1})}, 1)
    assert _judge(checker, [_fail(10, 100.0)], [(5, 90.0, without)]) == ([], 0, 0)


def test_planted_drop_failure_reaches_the_ledger_but_not_etcd(etcd):
    racks = [synthetic.rack(f"r{i}", 2, 2) for i in range(2)]
    plant_nodes = frozenset(racks[1].nodes)
    fleet = NodeFleet(etcd, racks, "drop-failure", plant_nodes)
    fleet.register()
    rng = random.Random(3)
    while not fleet.dropped:
        fleet.inject(rng)
    [(node, gpu)] = fleet.dropped
    assert node in plant_nodes
    _, _, ev_node, ledger, failure, ev_gpu = fleet.events[-1]
    assert (ev_node, ev_gpu, failure) == (node, gpu, True) and gpu in ledger
    stored = codec.decode(types_pb2.NodeHealth, etcd.get(keys.health(node)).value, keys.health(node))
    assert {g.index for g in stored.gpus if g.state == types_pb2.GPU_FAILED} == set(ledger) - {gpu}
    for _ in range(200):  # never recovered, never written as failed
        fleet.inject(rng)
    assert gpu in fleet.failed[node] and fleet.dropped == {(node, gpu)}
    stored = codec.decode(types_pb2.NodeHealth, etcd.get(keys.health(node)).value, keys.health(node))
    assert gpu not in {g.index for g in stored.gpus if g.state == types_pb2.GPU_FAILED}
    assert planted({"TPFLEX_BENCH_PLANT": "drop-failure"}) == "drop-failure" and planted({}) is None
    with pytest.raises(ValueError, match="drop-failure"):
        planted({"TPFLEX_BENCH_PLANT": "kill-rest-child"})
