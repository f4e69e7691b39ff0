"""The one varint implementation against protobuf's own encoder (an independent
reference): encoding, its length and decoding agree for edge and random values."""

from __future__ import annotations

import pytest
from google.protobuf.internal import decoder, encoder
from hypothesis import given
from hypothesis import strategies as st
from tpflex_proto.wire import decode_varint, encode_varint, varint_len


def _reference(n: int) -> bytes:
    out: list[bytes] = []
    encoder._VarintEncoder()(out.append, n, True)
    return b"".join(out)


@given(st.integers(min_value=0, max_value=(1 << 64) - 1))
def test_varints_match_protobuf(n):
    data = _reference(n)
    assert encode_varint(n) == data
    assert varint_len(n) == len(data)
    assert decode_varint(b"\x01" + data + b"\x02", 1) == (n, 1 + len(data))
    assert decoder._DecodeVarint(data, 0) == (n, len(data))


@pytest.mark.parametrize("data", [b"", b"\x80", b"\xff\xff"])
def test_a_cut_off_varint_is_refused(data):
    with pytest.raises(ValueError, match="truncated"):
        decode_varint(data, 0)
