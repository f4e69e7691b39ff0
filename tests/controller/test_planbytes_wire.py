"""planbytes.replica_wire, the replica encoding written out, against protobuf's own
deterministic encoding of convert's ReplicaPlan (the reference), over random replicas
with the fields' edge values: zeros, empty and non-ASCII names, GPU index 0, the largest
uint32, out-of-range numbers (then the writer declines and protobuf builds it)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tpflex_controller import convert
from tpflex_controller.planbytes import PlanEncoder, replica_wire
from tpflex_controller.planner.model import (
    PlanResult,
    Policy,
    ReplicaAssignment,
    ReplicaState,
    StageAssignment,
)
from tpflex_proto import codec, types_pb2

_u32 = st.one_of(st.sampled_from([0, 1, 127, 128, 300, 16_383, 16_384, (1 << 32) - 1]), st.integers(0, 1 << 20))
_names = st.sampled_from(["", "r0", "r0-n17", "rück-ñ", "x" * 130])
_gpus = st.tuples(_names, st.one_of(_u32, st.sampled_from([-1, 1 << 32])))
_stages = st.builds(StageAssignment, rack=_names, tp_degree=_u32,
                    gpus=st.lists(_gpus, max_size=20).map(tuple), spec_stage=_u32)
_replicas = st.builds(
    ReplicaAssignment,
    index=st.one_of(_u32, st.just(-3)),
    state=st.sampled_from(list(ReplicaState)),
    stages=st.lists(_stages, max_size=3).map(tuple),
    tp_degree=_u32,
    local_batch=_u32,
    relative_throughput=st.one_of(st.sampled_from([0.0, -0.0, 1.0, 0.5813, 1e-300]),
                                  st.floats(allow_nan=False)),
    reason=_names,
)


def _reference(r: ReplicaAssignment) -> bytes:
    one = PlanResult(job="", policy=Policy.NTP_PW, replicas=(r,), power_caps={},
                     expected_throughput_ratio=0.0, reasons=())
    holder = types_pb2.Plan()
    holder.replicas.append(convert.plan_to_proto(one, 0).replicas[0])
    return codec.encode(holder)


def _encodable(r: ReplicaAssignment) -> bool:
    try:
        _reference(r)
    except ValueError:
        return False
    return True


@settings(max_examples=400, deadline=None)
@given(_replicas)
def test_the_written_out_replica_is_protobufs_encoding(r):
    wire = replica_wire(r)
    if not _encodable(r):  # protobuf refuses it (a negative or too large uint32)
        assert wire is None
        return
    if wire is not None:
        assert wire == _reference(r)
    else:  # declined: only for a zero throughput
        assert r.relative_throughput == 0.0
    assert PlanEncoder()._replica_bytes(r) == _reference(r)  # either way, the encoder's bytes


_watts = st.one_of(st.sampled_from([0.0, -0.0, 700.0, 1300.5, -5.0, 1e-300]), st.floats(allow_nan=False), st.integers(-5, 2000))
_caps = st.lists(st.tuples(st.one_of(_u32, st.sampled_from([-1, 1 << 32])), _watts), max_size=6)
_gens = st.one_of(st.sampled_from([0, 1, 127, 128, (1 << 64) - 1]), st.integers(0, 1 << 40))


@settings(max_examples=400, deadline=None)
@given(node=_names, generation=_gens, caps=_caps)
def test_the_written_out_power_plans_are_protobufs_encoding(node, generation, caps):
    """A node's desired power as stored (``power/<node>``, NodePowerPlan) and as pushed
    to its agent (ApplyPowerPlanRequest), written out, against protobuf's own encoding."""
    from tpflex_controller.planbytes import apply_request_wire, power_plan_wire
    from tpflex_proto import agent_pb2

    try:
        pcs = [types_pb2.PowerCap(gpu=types_pb2.GpuRef(node=node, index=i), cap_w=w) for i, w in caps]
    except ValueError:  # protobuf refuses an index out of range: so must the writers
        pcs = None
    # a list, then a tuple twice (a node's caps as the view keeps them); the encoder's
    # writer keeps the GPUs' cap prefixes from its first call
    forms = (caps, tuple(caps), tuple(caps))
    encoder = PlanEncoder()  # the commit's writer: from the cap prefixes it keeps (twice: kept)
    if pcs is None:
        for form in forms:
            for write in (power_plan_wire, apply_request_wire, encoder.power_wire):
                with pytest.raises(ValueError):
                    write(node, generation, form)
        return
    plan = types_pb2.NodePowerPlan(node=node, generation=generation, caps=pcs)
    request = agent_pb2.ApplyPowerPlanRequest(generation=generation, caps=pcs)
    for form in forms:
        assert power_plan_wire(node, generation, form) == codec.encode(plan)
        assert encoder.power_wire(node, generation, tuple(form)) == codec.encode(plan)
        assert apply_request_wire(node, generation, form) == request.SerializeToString(deterministic=True)
        if generation + 1 < 1 << 64:  # the same caps at the next generation: the kept bodies
            later = types_pb2.NodePowerPlan(node=node, generation=generation + 1, caps=pcs)
            assert power_plan_wire(node, generation + 1, form) == codec.encode(later)
