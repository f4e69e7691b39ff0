"""Protobuf wire-format varints, the one implementation (pure): the plan writer's
hand-encoded bytes (tpflex_controller.planbytes), the commit's size accounting
(planning) and the plan store's field splitter (planstore) use these."""

from __future__ import annotations

_ONE_BYTE = tuple(bytes((n,)) for n in range(0x80))


def encode_varint(n: int) -> bytes:
    """The varint encoding of ``n`` >= 0."""
    if 0 <= n < 0x80:
        return _ONE_BYTE[n]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def varint_len(n: int) -> int:
    """Bytes of ``encode_varint(n)``."""
    return max(1, (n.bit_length() + 6) // 7)


def decode_varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it) of the varint at ``data[pos:]``; ValueError when cut off."""
    out = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        b = data[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        if not b & 0x80:
            return out, pos
        shift += 7
