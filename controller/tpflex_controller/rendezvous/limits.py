"""Bounds of the rendezvous store and the checks of its inputs (pure)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from tpflex_proto import keys


class StoreErrorCode(Enum):
    INVALID_ARGUMENT = "invalid_argument"  # malformed or oversized input
    NOT_FOUND = "not_found"  # no such job
    RESOURCE_EXHAUSTED = "resource_exhausted"  # the job's key space is full
    FAILED_PRECONDITION = "failed_precondition"  # add() on a value that is not an integer
    ABORTED = "aborted"  # a compare-and-swap kept losing (contention) until the deadline


class StoreError(Exception):
    def __init__(self, code: StoreErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class RendezvousLimits:
    """Per job: a lease of ``ttl_s`` (refreshed by every write and by tpflex-run's
    keep-alive), at most ``max_keys`` keys of at most ``max_key_bytes`` bytes with values of
    at most ``max_value_bytes``; a request names at most ``max_keys_per_request`` keys.
    A Get/Wait is parked at most ``max_wait_s`` per call, with at most ``max_parked``
    calls parked at once per replica (beyond that the call answers busy at once)."""

    ttl_s: int = 600
    max_keys: int = 200_000
    max_key_bytes: int = 1024
    max_value_bytes: int = 1 << 20
    max_keys_per_request: int = 4096
    max_wait_s: float = 10.0
    max_parked: int = 16
    cas_deadline_s: float = 10.0  # add/compare_set retry a lost compare-and-swap this long


def check_job(job: str) -> None:
    if not keys.job_name_ok(job):
        raise StoreError(StoreErrorCode.INVALID_ARGUMENT,
                         "job must be a job name (1-128 printable characters, no '/')")


def check_key(key: str, limits: RendezvousLimits, what: str = "key") -> None:
    size = len(key.encode())
    if size == 0:
        raise StoreError(StoreErrorCode.INVALID_ARGUMENT, f"{what} must not be empty")
    if size > limits.max_key_bytes:
        raise StoreError(StoreErrorCode.INVALID_ARGUMENT,
                         f"{what} is {size} bytes; at most {limits.max_key_bytes}")
    if "\x00" in key:
        raise StoreError(StoreErrorCode.INVALID_ARGUMENT, f"{what} must not contain NUL")


def check_keys(names: Sequence[str], limits: RendezvousLimits) -> None:
    if not names:
        raise StoreError(StoreErrorCode.INVALID_ARGUMENT, "keys must name at least one key")
    if len(names) > limits.max_keys_per_request:
        raise StoreError(StoreErrorCode.INVALID_ARGUMENT,
                         f"{len(names)} keys in one request; at most {limits.max_keys_per_request}")
    for k in names:
        check_key(k, limits)


def check_value(value: bytes, limits: RendezvousLimits, what: str = "value") -> None:
    if len(value) > limits.max_value_bytes:
        raise StoreError(StoreErrorCode.INVALID_ARGUMENT,
                         f"{what} is {len(value)} bytes; at most {limits.max_value_bytes}")


_COUNTER = re.compile(rb"\s*([+-]?\d+)")
_INT64 = (-(1 << 63), (1 << 63) - 1)


def parse_counter(value: bytes, key: str) -> int:
    """A c10d counter as add() reads it (C++ ``std::stoll``: optional white space and sign,
    then the leading digits; an empty value counts as 0)."""
    if not value:
        return 0
    m = _COUNTER.match(value)
    n = int(m.group(1)) if m else None
    if n is None or not _INT64[0] <= n <= _INT64[1]:
        raise StoreError(StoreErrorCode.FAILED_PRECONDITION,
                         f"key {key!r} holds a value that is not a 64-bit integer; add() needs one")
    return n
