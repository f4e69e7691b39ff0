"""planstore.fields, the top-level wire-format split the plan assembler runs on every
part of every generation: against protobuf's own parser on random plans (each piece is
one whole field of the number given, the pieces join to the input), and truncated input
raises ValueError, never a wrong split."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tpflex_proto import planstore, types_pb2

_text = st.text(alphabet="abcdefghij-0123456789", max_size=150)  # long names: 2-byte lengths


@st.composite
def plans(draw) -> bytes:
    p = types_pb2.Plan(job=draw(_text), generation=draw(st.integers(0, 2**40)), policy=draw(_text))
    for i in range(draw(st.integers(0, 3))):
        r = p.replicas.add(index=i, tp_degree=draw(st.integers(0, 300)), reason=draw(_text))
        stage = r.stages.add(rack=draw(_text))
        for j in range(draw(st.integers(0, 40))):
            stage.gpus.add(node=draw(_text), index=j)
    for j in range(draw(st.integers(0, 80))):
        p.power_caps.add(gpu=types_pb2.GpuRef(node=draw(_text), index=j), cap_w=draw(st.floats(0, 2000)))
    p.expected_throughput_ratio = draw(st.floats(0, 1))
    p.reasons.extend(draw(st.lists(_text, max_size=3)))
    return p.SerializeToString(deterministic=True)


@settings(max_examples=300, deadline=None)
@given(plans(), st.data())
def test_fields_split_a_plan_into_its_top_level_fields(data, draw):
    got = planstore.fields(data)
    assert b"".join(raw for _, raw in got) == data
    for num, raw in got:
        one = types_pb2.Plan.FromString(raw)
        assert [f.number for f, _ in one.ListFields()] == [num]  # one whole field, that number
    if data:
        cut = draw.draw(st.integers(0, len(data) - 1))
        bounds = {0}
        at = 0
        for _, raw in got:
            at += len(raw)
            bounds.add(at)
        if cut in bounds:  # a cut between fields is a shorter valid message
            assert b"".join(raw for _, raw in planstore.fields(data[:cut])) == data[:cut]
        else:
            try:
                planstore.fields(data[:cut])
            except ValueError:
                pass
            else:
                raise AssertionError(f"a cut inside a field at {cut} was split without error")
