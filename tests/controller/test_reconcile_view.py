"""Pure parts of the reconcile loop: the incremental view agrees with the whole-snapshot
conversion, folding says which jobs to look at and why, and the plan encoder is
byte-identical to the reference encoding."""

from __future__ import annotations

from tpflex_controller import convert, synthetic
from tpflex_controller.cache import ClusterView
from tpflex_controller.planbytes import PlanEncoder
from tpflex_controller.planner import plan
from tpflex_controller.planner.model import GpuStatus
from tpflex_proto import codec, keys, types_pb2


def _view() -> ClusterView:
    v = ClusterView()
    for i in range(3):
        r = synthetic.rack(f"r{i}", 2, 2)
        v.fold("put", keys.rack(r.name), codec.encode(r), 1)
        for n in r.nodes:
            v.fold("put", keys.node(n), codec.encode(synthetic.node(n, r.name, 2)), 1)
    spec = synthetic.job("j", ["r0", "r1"], 4)
    assert v.fold("put", keys.job_spec("j"), codec.encode(spec), 2) == [("j", "job_spec")]
    return v


def _health(v: ClusterView, node: str, failed: set[int], rev: int):
    return v.fold("put", keys.health(node), codec.encode(synthetic.failed_health(node, 2, failed)), rev)


def test_folding_marks_the_jobs_of_the_rack_with_a_cause():
    v = _view()
    assert _health(v, "r1-n00", {1}, 3) == [("j", "gpu_failed")]
    assert _health(v, "r1-n00", {1}, 4) == []  # same state again: nothing to do
    assert _health(v, "r2-n00", {0}, 5) == []  # a rack the job does not use
    assert _health(v, "r1-n00", set(), 6) == [("j", "gpu_recovered")]
    assert v.fold("delete", keys.node("r0-n01"), b"", 7) == [("j", "node_lost")]
    assert v.fold("put", keys.node("r0-n01"), codec.encode(synthetic.node("r0-n01", "r0", 2)), 8) == [
        ("j", "node_joined")
    ]
    drain = types_pb2.GpuOverride(gpu=types_pb2.GpuRef(node="r0-n00", index=0), drained=True)
    assert v.fold("put", keys.gpu_override("r0-n00", 0), codec.encode(drain), 9) == [("j", "drain")]
    assert v.fold("put", keys.health("r0-n00"), b"\xff garbage", 10) == []  # skipped
    assert v.fold("delete", keys.gpu_override("r0-n00", 0), b"", 11) == [("j", "undrain")]


def test_incremental_state_equals_the_whole_snapshot_conversion():
    v = _view()
    _health(v, "r1-n00", {1}, 3)
    _health(v, "r0-n01", {0, 1}, 4)
    drain = types_pb2.GpuOverride(gpu=types_pb2.GpuRef(node="r1-n00", index=1), drained=True)
    v.fold("put", keys.gpu_override("r1-n00", 1), codec.encode(drain), 5)
    drain0 = types_pb2.GpuOverride(gpu=types_pb2.GpuRef(node="r1-n01", index=0), drained=True, power_cap_w=900)
    v.fold("put", keys.gpu_override("r1-n01", 0), codec.encode(drain0), 6)
    v.fold("delete", keys.node("r2-n01"), b"", 7)
    whole = convert.cluster_state(v.snap)
    assert dict(v.state.gpu_status) == dict(whole.gpu_status)
    assert v.state.gpu_status[("r1-n00", 1)] is GpuStatus.FAILED  # failed wins over drained
    assert dict(v.state.power_pins) == dict(whole.power_pins)
    assert set(v.state.live_nodes) == set(whole.live_nodes)
    assert v.healthy_gpus("r1") == 2 and v.healthy_gpus("r0") == 2


def test_plan_encoder_is_byte_identical_to_the_reference_encoding():
    v = _view()
    enc = PlanEncoder()
    job = v.job_spec("j")
    healthy = plan(v.state, job)
    degraded_state = (_health(v, "r1-n01", {0}, 3), v.state)[1]
    degraded = plan(degraded_state, job)
    for result in (healthy, degraded, healthy):  # cold, partly cached, fully cached
        for gen in (1, 7):
            want = codec.encode(convert.plan_to_proto(result, gen, cause="gpu_failed", now=12.5))
            assert enc.encode(result, gen, cause="gpu_failed", now=12.5) == want


def test_operator_bursts_are_coalesced_and_failures_are_not():
    from tpflex_controller.workqueue import DirtyJob, coalesce_until

    d = DirtyJob("drain", 0.0, first_seen=100.0, urgent=False)
    assert coalesce_until(d, 100.0, 0.25) == 100.25  # quiet period after the latest
    d.not_before = 100.25
    assert coalesce_until(d, 100.5, 0.25) == 100.75  # extended by the next one
    assert coalesce_until(d, 101.9, 0.25) == 102.0  # but at most 8 x quiet after the first
    assert coalesce_until(d, 100.5, 0.0) == 100.25  # coalescing off: as it was
    d.urgent, d.not_before = True, 0.0
    assert coalesce_until(d, 100.5, 0.25) == 0.0  # a failure is planned at once


def test_own_commit_marks_its_keys_so_a_late_watch_event_cannot_move_the_view_back():
    from types import SimpleNamespace

    from tpflex_controller.cache import ClusterView
    from tpflex_proto import codec, keys, types_pb2

    view = ClusterView()
    older = types_pb2.Plan(job="j", generation=5)
    newer = types_pb2.Plan(job="j", generation=6)
    from tpflex_controller.planning import PlanCommit

    commit = PlanCommit("j", 6, codec.encode(newer), 100)
    view.record_commit(SimpleNamespace(job="j", result=None), commit, {}, rev=102)
    view.fold("put", keys.job_plan("j"), codec.encode(older), 100)  # the watch, late
    assert view.plans["j"].generation == 6 and view.plans["j"].mod_revision == 102
