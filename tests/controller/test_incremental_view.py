"""The reconcile view's change records drive incremental re-planning to the whole-job plan:
random health writes and node losses folded into a ClusterView, then replan() with the
view's take_changes() equals plan() on the view's state (hypothesis)."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st
from tpflex_controller import synthetic
from tpflex_controller.cache import ClusterView
from tpflex_controller.planner import plan
from tpflex_controller.planner.incremental import plan_job, replan
from tpflex_proto import codec, keys, types_pb2

RACKS = [synthetic.rack(f"r{i}", 3, 2, budget_factor=1.05) for i in range(4)]
NODES = [n for r in RACKS for n in r.nodes]


def _view() -> ClusterView:
    view = ClusterView()
    rev = 1
    for r in RACKS:
        view.fold("put", keys.rack(r.name), codec.encode(r), rev)
        for n in r.nodes:
            view.fold("put", keys.node(n), codec.encode(synthetic.node(n, r.name, 2)), rev)
    spec = synthetic.job("j", [r.name for r in RACKS], 6, units={"heads": 6})
    view.fold("put", keys.job_spec("j"), codec.encode(spec), rev)
    return view


events = st.tuples(st.sampled_from(["health", "lost", "back"]), st.sampled_from(NODES),
                   st.sets(st.integers(0, 1)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(events, min_size=1, max_size=4), min_size=1, max_size=10))
def test_view_changes_drive_replan_to_the_whole_job_plan(batches):
    view = _view()
    spec = view.job_spec("j")
    prev = plan_job(view.state, spec)
    view.take_changes("j")
    rev = 10
    for batch in batches:
        for kind, node, failed in batch:
            rev += 1
            rack = next(r.name for r in RACKS if node in r.nodes)
            if kind == "health":
                value = codec.encode(synthetic.failed_health(node, 2, failed, rev))
                view.fold("put", keys.health(node), value, rev)
            elif kind == "lost":
                view.fold("delete", keys.node(node), b"", rev)
            else:
                view.fold("put", keys.node(node), codec.encode(synthetic.node(node, rack, 2)), rev)
        prev = replan(prev, view.state, view.job_spec("j"), view.take_changes("j"))
        assert view.state.node_racks is not None  # the planner's indexes are in use
        unindexed = dataclasses.replace(view.state, node_racks=None, down_nodes=None)
        assert prev.result == plan(view.state, view.job_spec("j")) == plan(unindexed, view.job_spec("j"))


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(st.lists(st.lists(events, min_size=1, max_size=4), min_size=1, max_size=10))
def test_cap_parts_shortcuts_equal_the_whole_caps(batches):
    """desired_power over the GPUs of the changed cap parts, and same_decision by parts,
    equal their answers over the whole caps."""
    from tpflex_controller.planning import _cap_candidates, desired_power

    view = _view()
    prev = plan_job(view.state, view.job_spec("j"))
    view.take_changes("j")
    rev = 10
    for batch in batches:
        for kind, node, failed in batch:
            rev += 1
            if kind == "health":
                view.fold("put", keys.health(node), codec.encode(synthetic.failed_health(node, 2, failed, rev)), rev)
        old = prev.result
        prev = replan(prev, view.state, view.job_spec("j"), view.take_changes("j"))
        new = prev.result
        candidates = _cap_candidates(old, new)
        assert candidates is not None
        assert desired_power(view, old.power_caps, new.power_caps, candidates) == desired_power(
            view, old.power_caps, new.power_caps
        )
        same = (old.policy, old.replicas, old.power_caps, old.suspended_pins) == (
            new.policy, new.replicas, new.power_caps, new.suspended_pins)
        assert new.same_decision(old) == same


overrides = st.tuples(st.sampled_from(["slow", "drain", "undrain", "pin", "unpin"]), st.sampled_from(NODES),
                      st.sets(st.integers(0, 1)))


def _fold(view: ClusterView, kind: str, node: str, gpus: set[int], rev: int) -> None:
    """One event of ``events`` or ``overrides`` (failed or slow GPUs, a node lost or
    back, GPUs drained or pinned and released) folded into the view at ``rev``."""
    rack = next(r.name for r in RACKS if node in r.nodes)
    if kind == "health":
        view.fold("put", keys.health(node), codec.encode(synthetic.failed_health(node, 2, gpus, rev)), rev)
    elif kind == "slow":
        health = synthetic.failed_health(node, 2, set(), rev)
        for g in health.gpus:
            g.relative_speed = 0.5 if g.index in gpus else 1.0
        view.fold("put", keys.health(node), codec.encode(health), rev)
    elif kind == "lost":
        view.fold("delete", keys.node(node), b"", rev)
    elif kind == "back":
        view.fold("put", keys.node(node), codec.encode(synthetic.node(node, rack, 2)), rev)
    else:
        for i in gpus:
            if kind in ("undrain", "unpin"):
                view.fold("delete", keys.gpu_override(node, i), b"", rev)
            else:
                o = types_pb2.GpuOverride(gpu=types_pb2.GpuRef(node=node, index=i), drained=kind == "drain",
                                          power_cap_w=500.0 if kind == "pin" else 0.0)
                view.fold("put", keys.gpu_override(node, i), codec.encode(o), rev)


def _touched(view: ClusterView) -> dict[str, set]:
    out: dict[str, set] = {}
    for g in [*view.gpu_status, *view.gpu_speed, *view.power_pins]:
        out.setdefault(g[0], set()).add(g)
    return out


@settings(max_examples=80, deadline=None, derandomize=True, database=None)
@given(st.lists(st.one_of(events, overrides), min_size=1, max_size=14))
def test_a_lazy_survey_plans_as_the_eager_one(sequence):
    """The view's per-node index of touched GPUs (failed, slow, drained, pinned) stays
    equal to its definition, and with it a lazy survey (an incremental re-plan's) plans
    every replica, and each one alone, as the survey that indexes them all first."""
    from tpflex_controller.planner.planner import context, plan_replicas

    view = _view()
    for rev, (kind, node, gpus) in enumerate(sequence, start=10):
        _fold(view, kind, node, gpus, rev)
        assert view.state.touched_by_node == _touched(view)
    spec = view.job_spec("j")
    ctx = context(view.state, spec, None, None, None)
    every = list(range(len(spec.replicas)))
    for indices in (every, *([i] for i in every)):
        lazy = plan_replicas(ctx, view.state, spec, indices, lazy=True)
        assert lazy == plan_replicas(ctx, view.state, spec, indices, lazy=False)
        assert lazy == plan_replicas(ctx, view.state, spec, indices, lazy=True, lone=False)


@settings(max_examples=80, deadline=None, derandomize=True, database=None)
@given(st.lists(st.lists(st.one_of(events, overrides), min_size=1, max_size=4), min_size=1, max_size=10))
def test_what_the_planner_says_it_changed_gives_what_a_full_walk_gives(batches):
    """A commit's event reasons, changed cap parts and encoded parts, from the positions
    the planner says it planned again (model.changed_since), equal the same computed over
    every replica (the event's reasons, a scan of every cap part, a fresh encoder)."""
    from tpflex_controller.planbytes import PlanEncoder
    from tpflex_controller.planner.model import changed_cap_parts, changed_since
    from tpflex_controller.planning import decision_reasons, event_reasons

    view = _view()
    prev = plan_job(view.state, view.job_spec("j"))
    view.take_changes("j")
    encoder = PlanEncoder()
    encoder.split(prev.result, 1)
    hinted = 0
    rev = 10
    for gen, batch in enumerate(batches, start=2):
        for kind, node, gpus in batch:
            rev += 1
            _fold(view, kind, node, gpus, rev)
        old = prev.result
        prev = replan(prev, view.state, view.job_spec("j"), view.take_changes("j"))
        new = prev.result
        hinted += changed_since(old, new) is not None
        assert decision_reasons(old, new) == event_reasons(old.reasons, new.reasons)
        a, b = old.cap_parts, new.cap_parts
        assert changed_cap_parts(old, new) == sorted(
            i for i in a.keys() | b.keys() if a.get(i) is not b.get(i) and a.get(i) != b.get(i))
        assert encoder.split(new, gen) == PlanEncoder().split(new, gen)
    assert hinted  # the shortcuts were taken
