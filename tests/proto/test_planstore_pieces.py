"""planstore.Assembler.whole with a job's kept parsed parts (``kept=``, what the REST
process passes for every generation it reads): over a random sequence of generations,
each replacing some parts, the bytes equal an assembly from scratch, and the kept parts are
exactly the last call's."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tpflex_proto import planstore, types_pb2

_names = st.sampled_from(["r0-n0", "r0-n1", "r1-n0", "r10-n3", "r2-n1"])


@st.composite
def parts(draw) -> bytes:
    p = types_pb2.Plan()
    r = p.replicas.add(index=draw(st.integers(0, 9)), tp_degree=draw(st.integers(1, 8)))
    r.stages.add(rack="r0").gpus.add(node=draw(_names), index=draw(st.integers(0, 3)))
    for _ in range(draw(st.integers(0, 4))):  # caps of GPUs that may repeat across parts
        p.power_caps.add(gpu=types_pb2.GpuRef(node=draw(_names), index=draw(st.integers(0, 3))),
                         cap_w=draw(st.sampled_from([700.0, 1000.0, 1300.0])))
    return p.SerializeToString()


@st.composite
def headers(draw) -> bytes:
    h = types_pb2.Plan(job="j", generation=draw(st.integers(1, 99)), policy="ntp-pw", split=True,
                       stored_replicas=3, expected_throughput_ratio=0.5, cause="c")
    for _ in range(draw(st.integers(0, 3))):  # caps of GPUs no replica holds
        h.power_caps.add(gpu=types_pb2.GpuRef(node=draw(_names), index=draw(st.integers(0, 3))), cap_w=500.0)
    return h.SerializeToString()


@settings(max_examples=200, deadline=None)
@given(first=st.lists(parts(), min_size=1, max_size=5),
       steps=st.lists(st.tuples(headers(), st.lists(st.tuples(st.integers(0, 4), parts()), max_size=3)),
                      min_size=1, max_size=6))
def test_kept_parts_assemble_the_same_bytes_as_from_scratch(first, steps):
    kept: dict = {}
    current = list(first)
    for header, replaced in steps:
        for pos, part in replaced:
            if pos < len(current):
                current[pos] = part  # a new generation's part at that position
        got = planstore.Assembler().whole(header, current, kept)
        assert got == planstore.Assembler().whole(header, current)
        assert set(kept) == set(current)  # the last call's parts only: no growth
        reference = types_pb2.Plan.FromString(got)
        caps = [(c.gpu.node, c.gpu.index) for c in reference.power_caps]
        assert caps == sorted(caps)


_lines = st.lists(st.sampled_from(["replica 1: rack r0 lost a GPU", "é ünïcode", "", "x" * 200]), max_size=3)


@settings(max_examples=200, deadline=None)
@given(parts_=st.lists(st.tuples(parts(), _lines), min_size=1, max_size=5), header=headers(), own=_lines,
       cached=st.booleans())
def test_the_parts_reasons_assemble_before_the_headers_own(parts_, header, own, cached):
    """Reasons stored with the parts (each replica's lines) and in the header (the plan's
    own): the assembly equals the plan protobuf itself builds with the replicas in part
    order, the caps sorted by GPU and the reasons in part order then the header's."""
    stored = []
    reference = types_pb2.Plan.FromString(header)
    reference.split, reference.stored_replicas = False, 0
    caps = list(reference.power_caps)
    for raw, lines in parts_:
        part = types_pb2.Plan.FromString(raw)
        part.reasons.extend(lines)
        stored.append(part.SerializeToString())
        reference.replicas.extend(part.replicas)
        caps.extend(part.power_caps)
        reference.reasons.extend(lines)
    reference.reasons.extend(own)
    reference.ClearField("power_caps")
    reference.power_caps.extend(sorted(caps, key=lambda c: (c.gpu.node, c.gpu.index)))
    h = types_pb2.Plan.FromString(header)
    h.reasons.extend(own)
    assembler = planstore.Assembler()
    kept: dict | None = {} if cached else None
    got = assembler.whole(h.SerializeToString(deterministic=True), stored, kept)
    if cached:  # the second call takes the parts as the first one parsed them
        got = assembler.whole(h.SerializeToString(deterministic=True), stored, kept)
    assert types_pb2.Plan.FromString(got) == reference
    assert got == reference.SerializeToString(deterministic=True)
