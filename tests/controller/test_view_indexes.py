"""The indexes the reconcile view keeps for the planner (ClusterState.node_racks and
down_nodes) stay equal to their definition, derived here from the view's racks and live
nodes, through random rack writes (nodes moved between racks, racks deleted), node
registrations and lease losses; once a node is listed by two racks they are withdrawn.
With them, a plan is the plan without them (hypothesis)."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st
from tpflex_controller import synthetic
from tpflex_controller.cache import ClusterView
from tpflex_controller.planner import PlanningError, plan
from tpflex_proto import codec, keys, types_pb2

NODES = [f"n{i}" for i in range(8)]
RACKS = ["ra", "rb", "rc"]


def _rack(name: str, nodes: list[str]) -> types_pb2.Rack:
    rack = synthetic.rack(name, 1, 2)
    del rack.nodes[:]
    rack.nodes.extend(nodes)
    return rack


steps = st.one_of(
    st.tuples(st.just("rack"), st.sampled_from(RACKS), st.lists(st.sampled_from(NODES), min_size=1, max_size=3,
                                                                  unique=True)),
    st.tuples(st.just("unrack"), st.sampled_from(RACKS), st.just([])),
    st.tuples(st.just("join"), st.sampled_from(NODES), st.just([])),
    st.tuples(st.just("leave"), st.sampled_from(NODES), st.just([])),
)


def _check(view: ClusterView, listed_twice: bool) -> None:
    state = view.state
    if listed_twice:
        assert state.node_racks is None and state.down_nodes is None
        return
    racked = {n: name for name, r in view.racks.items() for n in r.nodes}
    assert dict(state.node_racks) == racked
    assert set(state.down_nodes) == {n for n in racked if n not in state.live_nodes}


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(st.lists(steps, min_size=1, max_size=25))
def test_the_planner_indexes_follow_racks_and_leases(sequence):
    view = ClusterView()
    listed: dict[str, list[str]] = {}  # the racks' node lists, as written
    listed_twice = False
    for rev, (kind, name, nodes) in enumerate(sequence, start=1):
        if kind == "rack":
            others = {n for r, ns in listed.items() if r != name for n in ns}
            listed_twice |= bool(others & set(nodes))
            listed[name] = nodes
            view.fold("put", keys.rack(name), codec.encode(_rack(name, nodes)), rev)
        elif kind == "unrack":
            listed.pop(name, None)
            view.fold("delete", keys.rack(name), b"", rev)
        elif kind == "join":
            view.fold("put", keys.node(name), codec.encode(synthetic.node(name, "ra", 2)), rev)
        else:
            view.fold("delete", keys.node(name), b"", rev)
        _check(view, listed_twice)
    if listed_twice or not view.racks:
        return
    # and a plan over the racks there are, failed GPUs on the first nodes, is the same with them
    racks = sorted(view.racks)
    spec = synthetic.job("j", racks, 2, units={"heads": 4})
    view.fold("put", keys.job_spec("j"), codec.encode(spec), len(sequence) + 1)
    first = view.racks[racks[0]].nodes[0]
    view.fold("put", keys.health(first), codec.encode(synthetic.failed_health(first, 2, {0}, 1)),
              len(sequence) + 2)
    try:
        job = view.job_spec("j")
    except PlanningError:
        return
    unindexed = dataclasses.replace(view.state, node_racks=None, down_nodes=None)
    assert plan(view.state, job) == plan(unindexed, job)
