"""The load benchmark's checkers judge a lagging controller by what it could have read
(issue 14: with the controller slowed by tracemalloc, both checkers blamed it for plans it
made right on a state that a later one undid)."""

from __future__ import annotations

from tpflex_controller import convert, synthetic
from tpflex_controller.planner import plan as planner_plan
from tpflex_controller.planner.model import ClusterState, GpuStatus

from bench.load import DecisionChecker
from bench.load_oracle import InvariantOracle, job_states


def _setup():
    racks = [synthetic.rack(f"r{i}", 2, 2) for i in range(2)]
    jobs = {"j": synthetic.job("j", [r.name for r in racks], 4)}
    return racks, jobs, [n for r in racks for n in r.nodes]


def _plan(racks, jobs, failed, generation, lost=frozenset()):
    """The planner's answer, built here from the protobufs (not through the checker)."""
    infos = {r.name: convert.rack_info(r) for r in racks}
    status = {(n, i): GpuStatus.FAILED for n, idx in failed.items() for i in idx}
    live = frozenset(n for r in racks for n in r.nodes) - lost
    state = ClusterState(racks=infos, gpu_status=status, live_nodes=live)
    return convert.plan_to_proto(planner_plan(state, convert.job_spec(jobs["j"], infos)), generation)


# r1-n01 loses GPU 0 (rev 8); r0-n00 loses GPU 1 (rev 10) and gets it back (rev 12)
EVENTS = [(8, 0.0, "r1-n01", frozenset({0}), True, 0), (10, 0.0, "r0-n00", frozenset({1}), True, 1),
          (12, 0.0, "r0-n00", frozenset(), False, 1)]
S0, S1 = {}, {"r1-n01": frozenset({0})}
S2 = {**S1, "r0-n00": frozenset({1})}


def _lagging(racks, jobs):
    """A controller that decided generation 2 on the state after rev 8 but committed it
    after rev 12; then it read rev 10 (generation 3) and rev 12 (generation 4). Generation
    2 equals the planner's answer after rev 12 as well (the GPU is back)."""
    return [(5, 0.0, _plan(racks, jobs, S0, 1)), (13, 0.0, _plan(racks, jobs, S1, 2)),
            (14, 0.0, _plan(racks, jobs, S2, 3)), (15, 0.0, _plan(racks, jobs, S1, 4))]


def test_a_plan_on_a_state_a_later_write_undid_leaves_the_next_plan_its_failure():
    racks, jobs, nodes = _setup()
    plans = _lagging(racks, jobs)
    assert DecisionChecker(racks, jobs, nodes).check("j", plans, EVENTS) == (4, 0)
    assert InvariantOracle(racks, jobs).check("j", plans, EVENTS) == []


def test_a_lagging_plan_that_goes_back_is_still_caught():
    racks, jobs, nodes = _setup()
    good = _lagging(racks, jobs)
    # generation 3 reflects rev 10; generation 4 then goes back to the state before rev 8
    back = [*good[:3], (15, 0.0, _plan(racks, jobs, S0, 4))]
    assert DecisionChecker(racks, jobs, nodes).check("j", back, EVENTS) == (4, 1)
    found = InvariantOracle(racks, jobs).check("j", back, EVENTS)
    assert found and all("generation 4" in v for v in found)


def test_decision_checker_models_a_lost_node_as_the_controller_sees_it():
    racks, jobs, nodes = _setup()
    checker = DecisionChecker(racks, jobs, nodes)
    losses = [(20, "r0-n01")]  # its keys deleted at rev 20
    gone = frozenset({"r0-n01"})
    plans = [(5, 0.0, _plan(racks, jobs, S0, 1)), (9, 0.0, _plan(racks, jobs, S1, 2)),
             (21, 0.0, _plan(racks, jobs, S1, 3, lost=gone))]
    assert checker.check("j", plans, EVENTS[:1], losses) == (3, 0)
    assert checker.check_final("j", plans, EVENTS[:1], losses)
    # blind to the loss, generation 3 has no state to stand on
    assert checker.check("j", plans, EVENTS[:1]) == (3, 1)
    assert not checker.check_final("j", plans, EVENTS[:1])
    # planning the lost node's GPUs again after its loss is wrong, and so is dropping it early
    again = [*plans, (22, 0.0, _plan(racks, jobs, S1, 4))]
    assert checker.check("j", again, EVENTS[:1], losses) == (4, 1)
    early = [plans[0], (9, 0.0, _plan(racks, jobs, S1, 2, lost=gone))]
    assert checker.check("j", early, EVENTS[:1], losses) == (2, 1)


def test_job_states_fold_writes_and_losses_in_revision_order():
    states = job_states(EVENTS, [(11, "r0-n00")], lambda n: n.startswith("r0"))
    assert [(s.revision, s.failed, s.lost) for s in states] == [
        (0, {}, frozenset()),
        (10, {"r0-n00": frozenset({1})}, frozenset()),
        (11, {"r0-n00": frozenset({1})}, frozenset({"r0-n00"})),
    ]  # r1's write is another job's; the write at 12 came after the node was gone
