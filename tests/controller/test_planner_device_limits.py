"""Power limits from the devices (issue 39 part 2): the planner boosts within the tighter of
each GPU's reported limits and the rack record's, and runs a degraded replica whose GPUs
have no headroom (max limit = default, as on many H100/H200 SXM boards) as plain NTP,
saying so. Pure: the limits travel in ``RackInfo`` (convert.rack_info folds them from the
nodes' registrations)."""

from __future__ import annotations

import dataclasses
import math

from hypothesis import given, settings
from hypothesis import strategies as st
from tpflex_controller import convert, synthetic
from tpflex_controller.cache import ClusterView
from tpflex_controller.planner import plan
from tpflex_controller.planner.incremental import Changes, plan_job, replan
from tpflex_controller.planner.model import (
    ClusterState,
    GpuStatus,
    Policy,
    RackInfo,
    ReplicaState,
    gpu_max,
)
from tpflex_proto import codec, keys, types_pb2

from tests.controller.planner_fixtures import TDP, failed, make_job, make_rack, state

H100 = 700.0  # H100 SXM: max limit = default limit = 700 W


def limited(rack: RackInfo, max_w: float, per_gpu: dict | None = None) -> RackInfo:
    """``rack`` with its GPUs' max limit ``max_w`` (and some GPUs' own, below it)."""
    return dataclasses.replace(rack, max_w=max_w, gpu_max_w=per_gpu or {})


def test_no_headroom_replica_runs_as_plain_ntp_with_the_reason():
    racks = {"r0": limited(make_rack("r0", size=4), H100), "r1": make_rack("r1", size=4)}
    job = make_job(racks, 4, local_batch=8)
    cluster = state(racks, gpu_status=failed(("r0-n0", 1), ("r1-n1", 0)))
    result = plan(cluster, job)
    r0, r1 = result.replicas
    # no headroom: plain NTP, 3/4 of the batch, no cap on its GPUs
    assert r0.state is ReplicaState.DEGRADED and r0.tp_degree == 3
    assert r0.local_batch == 6 and math.isclose(r0.relative_throughput, 0.75)
    assert not any(g[0].startswith("r0-") for g in result.power_caps)
    assert "NTP (no power headroom: r0-n0, r0-n1 GPUs max limit = default 700 W)" in r0.reason
    line = next(x for x in result.reasons if x.startswith("replica 0:"))
    assert "-> NTP (no power headroom: r0-n0, r0-n1 GPUs max limit = default 700 W): " in line
    assert "local batch 6/8" in line
    assert not any("boost falls short" in x for x in result.reasons if x.startswith("replica 0:"))
    # headroom: boosted above TDP, within the max
    caps1 = {g: w for g, w in result.power_caps.items() if g[0].startswith("r1-")}
    assert caps1 and all(TDP < w <= racks["r1"].max_w for w in caps1.values())
    assert "NTP (no power headroom" not in r1.reason


def test_mixed_headroom_in_a_stage_boosts_to_its_lowest_max():
    rack = make_rack("r0", size=4)
    rack = limited(rack, 1000.0, {("r0-n1", 0): 760.0})  # one survivor can take 60 W more
    racks = {"r0": rack}
    job = make_job(racks, 4)
    result = plan(state(racks, gpu_status=failed(("r0-n0", 0))), job)
    (r,) = result.replicas
    caps = dict(result.power_caps)
    assert set(caps) == set(r.stages[0].gpus)
    assert set(caps.values()) == {760.0}  # uniform, at the lowest max of the used GPUs
    assert "NTP (no power headroom" not in r.reason and r.relative_throughput < 1.0
    # that GPU failed instead: the others boost to the rack's max (limited by the model)
    result = plan(state(racks, gpu_status=failed(("r0-n1", 0))), job)
    assert all(w > 760.0 for w in result.power_caps.values())


def test_one_gpu_without_headroom_in_a_stage_is_plain_ntp_and_named():
    rack = limited(make_rack("r0", size=4), 1000.0, {("r0-n1", 1): 700.0})
    racks = {"r0": rack}
    result = plan(state(racks, gpu_status=failed(("r0-n0", 0))), make_job(racks, 4))
    (r,) = result.replicas
    assert not result.power_caps
    assert "NTP (no power headroom: r0-n1 GPUs max limit = default 700 W)" in r.reason


def test_pipeline_replica_falls_back_to_ntp_only_when_no_reduced_stage_has_headroom():
    racks = {
        "a": limited(make_rack("a", size=4), H100),
        "b": make_rack("b", size=4),
        "c": limited(make_rack("c", size=4), H100),
        "d": make_rack("d", size=4),
    }
    job = make_job(racks, 4, stages=2, local_batch=8)
    # replica 0: stage a reduced, no headroom; b healthy -> plain ntp, both stages at TP 3
    # replica 1: c reduced without headroom, d reduced with it -> ntp-pw, d boosted
    cluster = state(racks, gpu_status=failed(("a-n0", 0), ("c-n0", 0), ("d-n1", 1)))
    result = plan(cluster, job)
    r0, r1 = result.replicas
    assert [s.tp_degree for s in r0.stages] == [3, 3] and r0.local_batch == 6
    assert "NTP (no power headroom: a-n0, a-n1 GPUs" in r0.reason
    assert "NTP (no power headroom" not in r1.reason
    assert [s.tp_degree for s in r1.stages] == [3, 3]  # each stage at its own degree
    assert any(g[0].startswith("d-") for g in result.power_caps)
    assert not any(g[0][0] in "abc" for g in result.power_caps)
    line = next(x for x in result.reasons if x.startswith("replica 1: rack c"))
    assert "not boosted (GPU max limit = default)" in line


def test_other_policies_ignore_headroom():
    racks = {"r0": limited(make_rack("r0", size=4), H100)}
    cluster = state(racks, gpu_status=failed(("r0-n0", 1)))
    for policy in (Policy.NTP, Policy.DP_DROP):
        result = plan(cluster, make_job(racks, 4), policy=policy)
        assert "no power headroom" not in " ".join(result.reasons)


def test_power_pins_are_clamped_to_the_gpus_own_max():
    rack = limited(make_rack("r0", size=4), 1000.0, {("r0-n0", 1): 750.0})
    racks = {"r0": rack}
    cluster = state(racks, power_pins={("r0-n0", 1): 990.0, ("r0-n1", 0): 990.0})
    caps = dict(plan(cluster, make_job(racks, 4)).power_caps)
    assert caps[("r0-n0", 1)] == 750.0 and caps[("r0-n1", 0)] == 990.0


MAXES = [650.0, 700.0, 700.4, 720.0, 800.0, 910.0, 1000.0, 1300.0]


@st.composite
def clusters(draw):
    size = 4
    racks: dict[str, RackInfo] = {}
    status: dict = {}
    for r in range(draw(st.integers(1, 4))):
        rack = make_rack(f"r{r}", size=size, headroom=draw(st.sampled_from([0.0, 0.1, 0.3, 0.6])))
        rack_max = draw(st.sampled_from(MAXES[1:]))
        per_gpu = {g: m for g in rack.gpus if (m := draw(st.sampled_from([None, *MAXES]))) is not None and m < rack_max}
        racks[rack.name] = limited(rack, rack_max, per_gpu)
        for g in draw(st.lists(st.sampled_from(rack.gpus), unique=True, max_size=2)):
            status[g] = draw(st.sampled_from([GpuStatus.FAILED, GpuStatus.DRAINED]))
    pins = {}
    if draw(st.booleans()):
        all_gpus = [g for r in racks.values() for g in r.gpus]
        pins = {g: draw(st.sampled_from([500.0, 800.0, 1200.0])) for g in draw(st.lists(st.sampled_from(all_gpus), unique=True, max_size=2))}
    stages = draw(st.sampled_from([s for s in (1, 2) if len(racks) % s == 0]))
    return ClusterState(racks=racks, gpu_status=status, power_pins=pins), stages


@settings(max_examples=150, deadline=None)
@given(clusters())
def test_caps_never_exceed_a_gpus_max_and_no_headroom_replicas_run_plain_ntp(drawn):
    cluster, stages = drawn
    job = make_job(dict(cluster.racks), 4, stages=stages, local_batch=8)
    result = plan(cluster, job)
    rack_of = {g: r for r in cluster.racks.values() for g in r.gpus}
    for g, w in result.power_caps.items():
        rack = rack_of[g]
        assert w <= gpu_max(rack, g) + 1e-9 and w <= rack.max_w + 1e-9
        assert w >= rack.min_w - 1e-9
    for r in result.replicas:
        if r.state is ReplicaState.DROPPED:
            continue
        used = {g for s in r.stages for g in s.gpus}
        boosted = {g: w for g, w in result.power_caps.items() if g in used and g not in cluster.power_pins}
        if "NTP (no power headroom" in r.reason:
            # plain ntp: every stage at the replica's degree, no boost, batch ~ t_r / T
            assert {s.tp_degree for s in r.stages} == {r.tp_degree} and not boosted
            assert r.local_batch == max(1, math.floor(8 * r.tp_degree / 4 + 1e-9)) or cluster.power_pins
        for s in r.stages:
            caps = {result.power_caps[g] for g in s.gpus if g in boosted}
            if caps:  # a boosted stage: one cap, above TDP, within every used GPU's max
                rack = cluster.racks[s.rack]
                assert len(caps) == 1 and caps.pop() > rack.tdp_w
                assert all(gpu_max(rack, g) > rack.tdp_w for g in s.gpus)
    # an incremental re-plan after one more failure equals the whole plan
    prev = plan_job(cluster, job)
    more = next((g for r in cluster.racks.values() for g in r.gpus if g not in cluster.gpu_status), None)
    if more is not None:
        after = dataclasses.replace(cluster, gpu_status={**cluster.gpu_status, more: GpuStatus.FAILED})
        again = replan(prev, after, job, Changes(nodes=frozenset({more[0]})))
        assert again.result.same_decision(plan(after, job)) and again.result.reasons == plan(after, job).reasons


def _device(index: int, max_w: float, default_w: float = H100, min_w: float = 200.0) -> types_pb2.GpuDevice:
    return types_pb2.GpuDevice(index=index, default_limit_w=default_w, min_limit_w=min_w, max_limit_w=max_w,
                               power_limit_w=default_w)


def _node(name: str, rack: str, maxes: list[float], **kw) -> types_pb2.Node:
    return types_pb2.Node(name=name, rack=rack, gpus=[_device(i, m, **kw) for i, m in enumerate(maxes)])


def test_rack_info_takes_the_tighter_of_device_and_rack_limits():
    rack = synthetic.rack("r", 2, 2, tdp_w=700.0, min_w=100.0, max_w=1300.0)
    h100 = {n: _node(n, "r", [700.0, 700.0]) for n in rack.nodes}
    info = convert.rack_info(rack, h100)
    assert (info.tdp_w, info.min_w, info.max_w, info.gpu_max_w) == (700.0, 200.0, 700.0, {})
    # mixed: the rack's max is the highest reported, the others per GPU
    mixed = {rack.nodes[0]: _node(rack.nodes[0], "r", [1000.0, 800.0]),
             rack.nodes[1]: _node(rack.nodes[1], "r", [1000.0, 1000.0])}
    info = convert.rack_info(rack, mixed)
    assert info.max_w == 1000.0 and info.gpu_max_w == {(rack.nodes[0], 1): 800.0}
    # the rack record tighter than the devices: the record's
    tight = synthetic.rack("r", 2, 2, tdp_w=700.0, min_w=100.0, max_w=900.0)
    assert convert.rack_info(tight, mixed).max_w == 900.0 and convert.rack_info(tight, mixed).gpu_max_w == {
        (rack.nodes[0], 1): 800.0}
    # a device's default below the record's TDP: the default
    low = {n: _node(n, "r", [1000.0, 1000.0], default_w=650.0) for n in rack.nodes}
    assert convert.rack_info(rack, low).tdp_w == 650.0
    # no range reported (lost at the agent's start, a sim registration): the record's
    unknown = {n: _node(n, "r", [0.0, 0.0]) for n in rack.nodes}
    assert convert.rack_info(rack, unknown) == convert.rack_info(rack)
    assert convert.rack_info(rack).max_w == 1300.0


def test_the_view_rebuilds_a_rack_when_a_node_registers_other_limits():
    v = ClusterView()
    r = synthetic.rack("r0", 2, 2, tdp_w=700.0, max_w=1300.0)
    v.fold("put", keys.rack(r.name), codec.encode(r), 1)
    spec = synthetic.job("j", ["r0"], 4)
    v.fold("put", keys.job_spec("j"), codec.encode(spec), 2)
    for n in r.nodes:
        v.fold("put", keys.node(n), codec.encode(_node(n, "r0", [1000.0, 1000.0])), 3)
    assert v.racks["r0"].max_w == 1000.0
    # the node re-registers (a new lease) reporting H100 limits: its rack is planned again
    dirty = v.fold("put", keys.node(r.nodes[0]), codec.encode(_node(r.nodes[0], "r0", [700.0, 700.0])), 4)
    assert dirty == [("j", "rack_changed")]
    assert v.racks["r0"].gpu_max_w == {(r.nodes[0], 0): 700.0, (r.nodes[0], 1): 700.0}
    assert v.racks["r0"] == convert.rack_info(r, v.snap.nodes)
    # the same limits again: nothing to do
    assert v.fold("put", keys.node(r.nodes[0]), codec.encode(_node(r.nodes[0], "r0", [700.0, 700.0])), 5) == []
    whole = convert.cluster_state(v.snap)
    assert whole.racks["r0"] == v.racks["r0"]
