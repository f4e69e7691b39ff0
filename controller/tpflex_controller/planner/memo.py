"""A small memo keyed by object identity, for immutable spec objects the caller reuses
between plans (a job's replica specs). The planner stays a pure function: a hit returns
exactly what a miss computes.

An entry lives as long as its key object and no longer: the memo holds the key through a
weak reference whose callback removes the entry when the key is freed. So an id is never
found under a stale entry (the entry goes before the id can be reused), the memo holds no
spec alive after its caller dropped it, and its size is bounded by the spec objects alive,
not by a limit: a caller that rebuilds its specs for every plan (a rack change, the cold
re-plan of ``bench/controller_scale.py``) frees the old entries when it frees the old
specs, not in a later plan's call (a limit emptied all at once cost a cold plan at 262,144
GPUs the release of 8,192 replica specs and their GPU tuples: tens of milliseconds).
Keys must support weak references (``ReplicaSpec`` has a weakref slot)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class _Ref(weakref.ref):
    __slots__ = ("key_id",)


class IdentityMemo(Generic[V]):
    def __init__(self) -> None:
        self._entries: dict[int, tuple[_Ref, V]] = {}
        entries = self._entries

        def forget(ref: _Ref) -> None:
            hit = entries.get(ref.key_id)
            if hit is not None and hit[0] is ref:
                entries.pop(ref.key_id, None)

        self._forget = forget

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Any, compute: Callable[[Any], V]) -> V:
        hit = self.peek(key)
        if hit is not None:
            return hit
        value = compute(key)
        self.put(key, value)
        return value

    def peek(self, key: Any) -> V | None:
        """The value memoised for ``key`` (None when absent)."""
        hit = self._entries.get(id(key))
        return hit[1] if hit is not None and hit[0]() is key else None

    def put(self, key: Any, value: V) -> None:
        ref = _Ref(key, self._forget)
        ref.key_id = id(key)
        self._entries[ref.key_id] = (ref, value)
