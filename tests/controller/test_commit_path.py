"""The commit path's shortcuts: a leader does not fold its own commits again when the
watch echoes them (the view it recorded at commit time equals what a fresh fold of etcd
gives), and the rank count of a plan is carried from the previous plan."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tpflex_controller.cache import ClusterView
from tpflex_controller.planbytes import cap_prefix, cap_wire
from tpflex_controller.planner import PlanningError, plan
from tpflex_controller.planner.incremental import Changes, plan_job, replan
from tpflex_controller.planning import rank_count, rank_count_since
from tpflex_proto import codec, keys, types_pb2

from tests.controller.controller_harness import controller_on_job, eventually, fail_gpu
from tests.controller.planner_fixtures import failed, make_racks, state
from tests.controller.planner_fixtures import make_job as planner_job


def _fresh_view(etcd) -> ClusterView:
    view = ClusterView()
    for kv in etcd.get_prefix(keys.PREFIX)[0]:
        view.fold("put", kv.key, kv.value, kv.mod_revision)
    return view


def _essence(view: ClusterView) -> tuple:
    plan = view.plans["job1"]
    power = dict(view.power)  # node -> (NodePower, revision)
    parts = {pos: sorted(gens) for pos, gens in view.plan_parts["job1"].gens.items()}
    return plan.generation, plan.mod_revision, plan.raw, power, parts, list(view.event_seqs)


def test_own_commits_leave_the_view_as_a_fresh_fold_of_etcd(etcd_server, etcd):
    with controller_on_job(etcd_server, etcd, history_size=2) as (_, watcher, ctl):
        watcher.wait_generation(1)
        fail_gpu(etcd, "rack1-n00", 2, {1})
        watcher.wait_generation(2)
        fail_gpu(etcd, "rack0-n01", 2, {0})
        watcher.wait_generation(3)
        fail_gpu(etcd, "rack1-n00", 2, set(), seq=2)
        watcher.wait_generation(4)
        want = _essence(_fresh_view(etcd))
        eventually(lambda: _essence(ctl.reconciler.view) == want)


def test_rank_count_since_the_last_plan_equals_a_recount():
    racks = make_racks(4, size=4)
    job = planner_job(racks, 4)
    first = plan_job(state(racks), job)
    count = rank_count(first.result)
    prev = first
    lost = []
    for node, gpu in [("r1-n0", 1), ("r2-n1", 0), ("r1-n1", 1), ("r3-n0", 0), ("r3-n0", 1)]:
        lost.append((node, gpu))
        nxt = replan(prev, state(racks, gpu_status=failed(*lost)), job, Changes(nodes=frozenset({node})))
        count = rank_count_since(prev.result, count, nxt.result)
        assert count == rank_count(nxt.result)
        prev = nxt
    assert count < rank_count(first.result)


@given(st.text(max_size=140), st.integers(0, (1 << 32) - 1),
       st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -0.0, 700.0, 1e-300]))
def test_cap_bytes_written_out_equal_protobufs_encoding(node, index, watts):
    holder = types_pb2.Plan()
    holder.power_caps.add(gpu=types_pb2.GpuRef(node=node, index=index), cap_w=watts)
    assert cap_wire((node, index), watts) == codec.encode(holder)


@given(st.text(max_size=140), st.integers(0, (1 << 32) - 1),
       st.floats(min_value=1e-300, allow_infinity=True) | st.sampled_from([700.0, 1e-300, 5e-324]))
def test_cap_prefix_and_the_watts_are_the_caps_bytes(node, index, watts):
    prefix = cap_prefix((node, index))
    assert (prefix is None) == (not node)
    if prefix is not None:
        assert prefix + struct.pack("<d", watts) == cap_wire((node, index), watts)


def test_a_rack_that_left_named_in_the_changes_is_not_planned_on():
    racks = make_racks(3, size=4)
    job = planner_job(racks, 4)
    prev = plan_job(state(racks), job)
    gone = {name: r for name, r in racks.items() if name != "r1"}
    with pytest.raises(PlanningError, match="unknown rack"):
        plan(state(gone), job)
    with pytest.raises(PlanningError, match="unknown rack"):
        replan(prev, state(gone), job, Changes(racks=frozenset({"r1"})))


def test_event_reasons_are_the_added_then_the_resolved_ones_bounded():
    from tpflex_controller.planning import MAX_EVENT_REASONS, event_reasons

    first = tuple(f"replica {i}: TP 3" for i in range(100))
    assert event_reasons(None, first) == list(first[:MAX_EVENT_REASONS])
    old = ("replica 0: TP 3", "replica 1: TP 3", "replica 2: TP 2")
    new = ("replica 0: TP 3", "replica 2: TP 3", "replica 5: TP 1")
    assert event_reasons(old, new) == [
        "replica 2: TP 3", "replica 5: TP 1", "resolved: replica 1: TP 3", "resolved: replica 2: TP 2",
    ]
    assert event_reasons(new, new) == []
    many = tuple(f"replica {i}: TP 2" for i in range(100))
    got = event_reasons(first, many)
    assert len(got) == MAX_EVENT_REASONS and got == list(many[:MAX_EVENT_REASONS])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=20_000))
def test_a_put_written_in_place_counts_the_bytes_of_its_message(key, value):
    """commit_plan sizes its transactions (fits, _chunk) by these counts, and by a bound
    that is never below them."""
    from tpflex_controller.planning import _PUT_OVERHEAD, put_size
    from tpflex_proto.etcd import Op

    size = Op.put(key, value).ByteSize()
    assert put_size(key, value) == size
    assert size <= len(key) + len(value) + _PUT_OVERHEAD
