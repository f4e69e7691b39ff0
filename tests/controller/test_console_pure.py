"""Pure parts of the console: etcd key -> change record, plan diffs (hypothesis), the
compact rack rendering against the planner's own GPU states."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tpflex_controller import convert, plandiff, synthetic
from tpflex_controller.api.console import render
from tpflex_controller.api.feed import Change, Kind, Subscribers, classify
from tpflex_controller.store import Snapshot
from tpflex_proto import keys, types_pb2


@pytest.mark.parametrize("key, kind, name", [
    (keys.rack("r1"), Kind.RACK, "r1"),
    (keys.node("n1"), Kind.NODE, "n1"),
    (keys.health("n1"), Kind.HEALTH, "n1"),
    (keys.gpu_override("n-1", 3), Kind.GPU_OVERRIDE, "n-1"),
    (keys.job_override("llama"), Kind.JOB_OVERRIDE, "llama"),
    (keys.job_spec("llama"), Kind.JOB, "llama"),
    (keys.job_plan("llama"), Kind.PLAN, "llama"),
    (keys.job_plan_history("llama", 7), Kind.PLAN_HISTORY, "llama"),
    (keys.job_ack("llama", 5), Kind.ACK, "llama"),
    (keys.power("n1"), Kind.POWER, "n1"),
    (keys.event(42), Kind.EVENT, "42"),
    (keys.event(0), Kind.EVENT, "0"),
    (keys.LEADER, Kind.LEADER, ""),
    (keys.PREFIX + "steps/x", Kind.OTHER, ""),
    (keys.RACKS, Kind.OTHER, ""),  # the bare prefix names nothing
    (keys.GPU_OVERRIDES + "no-index", Kind.OTHER, ""),
    (keys.EVENTS + "not-a-number", Kind.OTHER, ""),  # keys.parse: not an event key
])
def test_every_key_kind_is_classified(key, kind, name):
    assert classify(key, 9, deleted=True) == Change(kind, name, 9, True)


def test_subscribers_survive_a_failing_handler_and_unsubscribe():
    subs, got = Subscribers(), []

    def bad(_):
        raise RuntimeError("boom")

    subs.subscribe(bad)
    stop = subs.subscribe(got.append)
    subs.publish([Change(Kind.LEADER, "", 1)])
    stop()
    subs.publish([Change(Kind.LEADER, "", 2)])
    subs.publish([])
    assert got == [[Change(Kind.LEADER, "", 1)]] and len(subs) == 1


# ---- plan diffs ----

_STATES = [types_pb2.REPLICA_HEALTHY, types_pb2.REPLICA_DEGRADED, types_pb2.REPLICA_DROPPED]


@st.composite
def plans(draw):
    n = draw(st.integers(0, 4))
    plan = types_pb2.Plan(job="j", generation=draw(st.integers(1, 9)),
                          policy=draw(st.sampled_from(["ntp-pw", "ntp"])),
                          expected_throughput_ratio=draw(st.sampled_from([1.0, 0.9, 0.75])))
    for i in range(n):
        if draw(st.booleans()) and i:
            continue  # a replica missing from this plan
        degree = draw(st.integers(0, 4))
        gpus = draw(st.lists(st.integers(0, 5), min_size=degree, max_size=degree, unique=True))
        r = plan.replicas.add(index=i, state=draw(st.sampled_from(_STATES)), tp_degree=degree,
                              local_batch=draw(st.sampled_from([4, 8])))
        r.stages.add(rack=f"r{i}", tp_degree=degree, gpus=[types_pb2.GpuRef(node=f"n{i}", index=g) for g in gpus])
    for g in draw(st.lists(st.integers(0, 5), unique=True, max_size=4)):
        plan.power_caps.add(gpu=types_pb2.GpuRef(node="n0", index=g), cap_w=draw(st.sampled_from([800.0, 900.0])))
    return plan


def _fields(plan: types_pb2.Plan | None) -> dict:
    """Every diffable field, computed independently of plandiff."""
    out = {}
    if plan is not None:
        out[("plan", "policy", None, None)] = plan.policy
        out[("plan", "expected_throughput_ratio", None, None)] = plan.expected_throughput_ratio
        for r in plan.replicas:
            out[("replica", "state", r.index, None)] = plandiff._REPLICA_STATE[r.state]
            out[("replica", "tp_degree", r.index, None)] = r.tp_degree
            out[("replica", "local_batch", r.index, None)] = r.local_batch
            out[("replica", "gpus", r.index, None)] = [f"{g.node}:{g.index}" for s in r.stages for g in s.gpus]
        for c in plan.power_caps:
            out[("power_cap", "cap_w", None, (c.gpu.node, c.gpu.index))] = c.cap_w
    return out


_ABSENT = {"state": plandiff.ABSENT, "tp_degree": 0, "local_batch": 0, "gpus": []}


@settings(max_examples=300, deadline=None)
@given(plans(), plans(), st.booleans())
def test_a_diff_lists_exactly_the_fields_that_differ(a, b, from_nothing):
    current = None if from_nothing else a
    changes = plandiff.diff(current, b)
    before, after = _fields(current), _fields(b)
    got = {(c.kind, c.field, c.replica, c.gpu): (c.before, c.after) for c in changes}
    assert len(got) == len(changes)  # no field twice
    for key in before.keys() | after.keys():
        kind, field = key[0], key[1]
        missing = None if kind != "replica" else _ABSENT[field]
        old, new = before.get(key, missing), after.get(key, missing)
        if kind == "plan" and current is None:
            old = None
        if old != new:
            assert got.pop(key) == (old, new), key
    assert got == {}
    assert plandiff.diff(b, b) == []


# ---- rack rendering ----


def test_rack_codes_follow_the_planners_gpu_states_and_caps_skip_tdp():
    rack = synthetic.rack("r", nodes_per_rack=2, gpus_per_node=2, tdp_w=700.0)
    snap = Snapshot(racks={"r": rack}, nodes={"r-n00": synthetic.node("r-n00", "r", 2)})  # r-n01: lease lapsed
    snap.health["r-n00"] = synthetic.failed_health("r-n00", 2, {1})
    snap.gpu_overrides[("r-n00", 0)] = types_pb2.GpuOverride(gpu=types_pb2.GpuRef(node="r-n00", index=0), drained=True)
    state = convert.cluster_state(snap)
    caps = {("r-n00", 0): 700.0, ("r-n01", 1): 900.0, ("elsewhere", 0): 800.0}
    out = render.render_rack(rack, state, caps)
    assert out["s"] == "dfff"  # drained; failed (XID); both GPUs of the lapsed node failed
    assert out["caps"] == {"3": 900.0}  # TDP is implied, other racks' GPUs left out
    assert out["nodes"] == ["r-n00", "r-n01"] and out["gpn"] == 2 and out["tdp"] == 700.0
    snap.health["r-n00"].gpus[1].state = types_pb2.GPU_DEGRADED
    assert render.render_rack(rack, convert.cluster_state(snap), {})["s"] == "dgff"


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_rack_codes_equal_the_planners_status_of_every_gpu(data):
    """The per-node fast path gives what ClusterState.status says for each GPU."""
    nodes, gpn = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    rack = synthetic.rack("r", nodes_per_rack=nodes, gpus_per_node=gpn)
    live = data.draw(st.sets(st.sampled_from(list(rack.nodes))))
    snap = Snapshot(racks={"r": rack}, nodes={n: synthetic.node(n, "r", gpn) for n in live})
    for n in rack.nodes:
        states = data.draw(st.lists(st.sampled_from([types_pb2.GPU_HEALTHY, types_pb2.GPU_DEGRADED,
                                                     types_pb2.GPU_FAILED]), min_size=gpn, max_size=gpn))
        if data.draw(st.booleans()):
            snap.health[n] = types_pb2.NodeHealth(node=n, gpus=[types_pb2.GpuHealth(index=i, state=s)
                                                                for i, s in enumerate(states)])
        for i in data.draw(st.sets(st.integers(0, gpn - 1))):
            snap.gpu_overrides[(n, i)] = types_pb2.GpuOverride(gpu=types_pb2.GpuRef(node=n, index=i), drained=True)
    state = convert.cluster_state(snap, racks={})
    expected = "".join(render.STATE_CODE[state.status(g)] for g in render.rack_gpus(rack))
    assert render.rack_codes(rack, state, render.unhealthy_by_node(state)) == expected
    assert render.render_rack(rack, state, {})["s"] == expected
