"""A small memo keyed by object identity, for immutable spec objects the caller reuses
between plans (a job's stage GPU tuples, its replica specs). It keeps each key object
alive while memoised, so an id is never reused for another object under its entry; it
empties itself when full. The planner stays a pure function: a hit returns exactly what
a miss computes.

The default limit (8,192 entries) covers a few 1,024-replica jobs while bounding memory
when a caller rebuilds its specs for every plan (each entry then goes stale)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class IdentityMemo(Generic[V]):
    def __init__(self, limit: int = 1 << 13) -> None:
        self._entries: dict[int, tuple[Any, V]] = {}
        self._limit = limit

    def get(self, key: Any, compute: Callable[[Any], V]) -> V:
        hit = self._entries.get(id(key))
        if hit is not None and hit[0] is key:
            return hit[1]
        value = compute(key)
        if len(self._entries) >= self._limit:
            self._entries.clear()
        self._entries[id(key)] = (key, value)
        return value

    def peek(self, key: Any) -> V | None:
        """The value memoised for ``key`` (None when absent)."""
        hit = self._entries.get(id(key))
        return hit[1] if hit is not None and hit[0] is key else None

    def put(self, key: Any, value: V) -> None:
        if len(self._entries) >= self._limit:
            self._entries.clear()
        self._entries[id(key)] = (key, value)
