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
    racks, jobs, nodes, node_rack = _setup()
    checker = DecisionChecker(racks, jobs, nodes)
    events = [(10, 0.0, "r0-n00", frozenset({1}), True), (12, 0.0, "r1-n01", frozenset({0}), True),
              (14, 0.0, "r0-n00", frozenset(), False)]
    s0, s1 = {}, {"r0-n00": frozenset({1})}
    s2 = {**s1, "r1-n01": frozenset({0})}
    s3 = {**s2, "r0-n00": frozenset()}
    # plan 1 before any event; plan 2 skipped s1 (coalesced); plan 3 after the recovery
    good = [(5, 0.0, _plan(checker, s0, 1)), (13, 0.0, _plan(checker, s2, 2)), (15, 0.0, _plan(checker, s3, 3))]
    assert checker.check("j", good, events, node_rack) == (3, 0)
    assert checker.check_final("j", good, events, node_rack)
    never = {"r1-n00": frozenset({1})}  # a state that never existed
    bad = [good[0], (13, 0.0, _plan(checker, never, 2)), good[2]]
    assert checker.check("j", bad, events, node_rack) == (3, 1)
    backwards = [good[0], good[1], (15, 0.0, _plan(checker, s1, 3))]  # the view went back in time
    assert checker.check("j", backwards, events, node_rack) == (3, 1)
    stale_final = good[:2]
    assert not checker.check_final("j", stale_final, events, node_rack)
