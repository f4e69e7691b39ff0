"""The load benchmark's offline oracle can tell a right decision from a wrong one."""

from __future__ import annotations

from tpflex_controller import convert, synthetic

from bench.load import DecisionChecker


def _setup():
    racks = [synthetic.rack(f"r{i}", 2, 2) for i in range(2)]
    job = synthetic.job("j", [r.name for r in racks], 4)
    nodes = [n for r in racks for n in r.nodes]
    return racks, {"j": job}, nodes, {n: r.name for r in racks for n in r.nodes}


def _plan(checker, failed, generation):
    return convert.plan_to_proto(checker.expected("j", failed), generation)


def test_decisions_on_states_the_cluster_passed_through_are_right_others_wrong():
    racks, jobs, nodes, _ = _setup()
    checker = DecisionChecker(racks, jobs, nodes)
    events = [(10, 0.0, "r0-n00", frozenset({1}), True), (12, 0.0, "r1-n01", frozenset({0}), True),
              (14, 0.0, "r0-n00", frozenset(), False)]
    s0, s1 = {}, {"r0-n00": frozenset({1})}
    s2 = {**s1, "r1-n01": frozenset({0})}
    s3 = {**s2, "r0-n00": frozenset()}
    # plan 1 before any event; plan 2 skipped s1 (coalesced); plan 3 after the recovery
    good = [(5, 0.0, _plan(checker, s0, 1)), (13, 0.0, _plan(checker, s2, 2)), (15, 0.0, _plan(checker, s3, 3))]
    assert checker.check("j", good, events) == (3, 0)
    assert checker.check_final("j", good, events)
    never = {"r1-n00": frozenset({1})}  # a state that never existed
    bad = [good[0], (13, 0.0, _plan(checker, never, 2)), good[2]]
    assert checker.check("j", bad, events) == (3, 1)
    backwards = [good[0], good[1], (15, 0.0, _plan(checker, s1, 3))]  # the view went back in time
    assert checker.check("j", backwards, events) == (3, 1)
    stale_final = good[:2]
    assert not checker.check_final("j", stale_final, events)


def test_invariant_oracle_flags_each_broken_rule_on_its_own():
    from tpflex_proto import types_pb2

    from bench.load_oracle import InvariantOracle

    racks, jobs, nodes, _ = _setup()
    checker = DecisionChecker(racks, jobs, nodes)
    oracle = InvariantOracle(racks, jobs)
    events = [(10, 0.0, "r0-n00", frozenset({1}), True, 1)]
    s1 = {"r0-n00": frozenset({1})}
    p1, p2 = _plan(checker, {}, 1), _plan(checker, s1, 2)
    assert oracle.check("j", [(5, 0.0, p1), (11, 0.0, p2)], events) == []
    assert oracle.check("j", [(5, 0.0, p1), (11, 0.0, p1)], events)  # generation 1 twice
    stale = types_pb2.Plan()
    stale.CopyFrom(p1)
    stale.generation = 2
    assert oracle.check("j", [(5, 0.0, p1), (11, 0.0, stale)], events) == []  # lag: decided before
    # the failed GPU planned again after a plan that left it out
    after = [(5, 0.0, p1), (11, 0.0, p2), (12, 0.0, stale)]
    stale.generation = 3
    assert any("failed GPU" in v for v in oracle.check("j", after, events))
    short = types_pb2.Plan()
    short.CopyFrom(p2)
    del short.replicas[1].stages[0].gpus[-1]  # degree 4 on 3 GPUs, 4 usable
    short.replicas[1].stages[0].tp_degree = 3
    assert any("usable GPUs 4" in v for v in oracle.check("j", [(5, 0.0, p1), (11, 0.0, short)], events))
    hot = types_pb2.Plan()
    hot.CopyFrom(p2)
    del hot.power_caps[:]
    rack = racks[1]  # 4 usable GPUs at max_w: 5,200 W on a 4,000 W budget
    for n in rack.nodes:
        for i in range(rack.gpus_per_node):
            hot.power_caps.add(gpu=types_pb2.GpuRef(node=n, index=i), cap_w=rack.gpu_max_w)
    found = oracle.check("j", [(5, 0.0, p1), (11, 0.0, hot)], events)
    assert any("above budget" in v for v in found)
    hot.power_caps[0].cap_w = rack.gpu_max_w + 1
    assert any("outside the GPU's limits" in v for v in oracle.check("j", [(5, 0.0, p1), (11, 0.0, hot)], events))
