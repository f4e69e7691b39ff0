"""Encoding of values stored in etcd: binary protobuf, one schema (types.proto).

``decode`` raises :class:`MalformedValue` for anything that is not a well-formed message
of the expected type, so readers can log and skip values written by something else.
"""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import DecodeError, Message

M = TypeVar("M", bound=Message)


class MalformedValue(ValueError):
    def __init__(self, key: str, type_name: str, why: str) -> None:
        super().__init__(f"malformed value at {key}: not a {type_name}: {why}")
        self.key = key


def encode(msg: Message) -> bytes:
    return msg.SerializeToString(deterministic=True)


def decode(cls: type[M], data: bytes, key: str = "?") -> M:
    msg = cls()
    try:
        msg.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise MalformedValue(key, cls.__name__, str(exc)) from exc
    # Protobuf is permissive: random bytes can parse as unknown fields. A value with
    # unknown fields was not written by this schema version's writers: refuse it.
    if _has_unknown_fields(msg):
        raise MalformedValue(key, cls.__name__, "unknown fields")
    return msg


def _has_unknown_fields(msg: Message) -> bool:
    from google.protobuf import unknown_fields

    if len(unknown_fields.UnknownFieldSet(msg)):
        return True
    for field, value in msg.ListFields():
        if field.message_type is None:
            continue
        if field.is_repeated:
            if field.message_type.GetOptions().map_entry:
                continue
            if any(_has_unknown_fields(v) for v in value):
                return True
        elif _has_unknown_fields(value):
            return True
    return False
