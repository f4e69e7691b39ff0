"""Read-only maps of power caps that a plan builds without per-GPU work (pure).

A plan at 262,144 GPUs boosts the used GPUs of every reduced stage: over 100,000 caps
when 1% of the GPUs fail across racks. Building one dict entry per GPU per plan (and
copying the job's map on every re-plan) cost more than the rest of the decision, so:

- ``UniformCaps``: one stage's caps, the same watts for every GPU it uses (a tuple of
  GPUs and one number);
- ``MergedCaps``: a plan's ``power_caps``, the union of its per-replica parts (a GPU held
  by two parts takes the higher replica's cap, as ``dict.update`` in replica order
  would). A re-plan's map is the previous one plus the replicas planned again
  (``MergedCaps.derive``): the GPU -> holder index of the root is built once, on the
  first point look-up, and shared by the maps derived from it, which index the GPUs of
  their differing parts apart, until too many replicas differ. Then the newest map
  becomes the root by patching the shared index in place, O(the differing parts' GPUs)
  (``_reroot``); the maps still rooted at the old root read the entries it changed from
  its undo record (Baker's trick for persistent arrays), so no map ever sees another's
  caps. Where the patch would not be simple (a GPU held by two parts), or the old root
  was already superseded, the new root indexes afresh on its first look-up.

Both are ``Mapping``s: equal to the dict with the same items, iterable, and as cheap as a
dict to query once indexed.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Mapping
from itertools import chain, repeat

from tpflex_controller.planner.model import GpuKey

# replicas re-planned since the root before a derived map becomes the root (patching the
# index in place costs O(their GPUs): about 1.5 ms for 33 NVL72 replicas, once per
# 32-odd re-plans; 64 gave twice the pause and a worse p99 at 1% of 262,144 GPUs failed)
_MAX_DIRTY = 32
# overlay entries a derived map keeps apart from the shared ones (about 14 racks' GPUs)
_MAX_RECENT = 1024
_REROOT = threading.Lock()  # one patch of an index at a time (a dry-run may plan in a thread)
_ABSENT = object()  # in an undo record: the root had no entry for the GPU
_UNCHANGED = object()


class UniformCaps(Mapping):
    """``dict.fromkeys(gpus, watts)`` without the dict (``gpus`` distinct)."""

    __slots__ = ("_set", "gpus", "watts")

    def __init__(self, gpus: tuple[GpuKey, ...], watts: float) -> None:
        self.gpus = gpus
        self.watts = watts
        self._set: frozenset[GpuKey] | None = None

    def _members(self) -> frozenset[GpuKey]:
        if self._set is None:
            self._set = frozenset(self.gpus)
        return self._set

    def __getitem__(self, gpu: GpuKey) -> float:
        if gpu in self._members():
            return self.watts
        raise KeyError(gpu)

    def __contains__(self, gpu: object) -> bool:
        return gpu in self._members()

    def __iter__(self) -> Iterator[GpuKey]:
        return iter(self.gpus)

    def __len__(self) -> int:
        return len(self.gpus)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, UniformCaps):
            if not self.gpus or not other.gpus:
                return not self.gpus and not other.gpus
            return self.watts == other.watts and (
                self.gpus == other.gpus or self._members() == other._members()
            )
        return Mapping.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"UniformCaps({len(self.gpus)} GPUs at {self.watts} W)"


class MergedCaps(Mapping):
    """The union of per-replica cap parts (``index -> caps``), indexed lazily."""

    __slots__ = ("_dict", "_dirty", "_next", "_overlay", "_owner", "_recent", "_root", "parts")

    def __init__(self, parts: Mapping[int, Mapping[GpuKey, float]]) -> None:
        self.parts = parts
        self._root: MergedCaps = self
        self._dirty: frozenset[int] = frozenset()  # replicas whose part may differ from root's
        # GPU -> the dirty replicas whose (current) part holds it, ascending: ``_recent``
        # (this map's own, small; () where none does) over ``_overlay`` (shared with the
        # maps it was derived from, never changed), so that a derive copies O(recent)
        self._overlay: dict[GpuKey, tuple[int, ...]] = {}
        self._recent: dict[GpuKey, tuple[int, ...]] = {}
        self._owner: dict[GpuKey, int | tuple[int, ...]] | None = None  # root only (_index)
        # root only: once a newer root patched the shared index, (undo, that root): the
        # entries as this root had them, for the GPUs the patch changed (_ABSENT: none)
        self._next: tuple[dict, MergedCaps] | None = None
        self._dict: dict[GpuKey, float] | None = None  # as_dict(), once asked for

    def derive(self, parts: Mapping[int, Mapping[GpuKey, float]], replanned) -> MergedCaps:
        """The map of ``parts``, which differ from this map's parts at most in the
        replicas ``replanned``; shares this map's index while few replicas differ (the
        GPUs of the differing parts are indexed apart, O(their GPUs))."""
        out = MergedCaps(parts)
        dirty = self._dirty.union(replanned)
        if len(dirty) > _MAX_DIRTY:
            self._reroot(out, dirty)  # else its own root, indexed afresh when first looked up
            return out
        base, recent = self._overlay, dict(self._recent)
        for i in replanned:
            for g in self.parts.get(i, ()):
                held = recent.get(g)
                if held is None:
                    held = base.get(g, ())
                recent[g] = tuple(x for x in held if x != i)
        for i in replanned:
            for g in parts.get(i, ()):
                held = recent.get(g)
                if held is None:
                    held = base.get(g, ())
                if i not in held:
                    recent[g] = tuple(sorted((*held, i)))
        if len(recent) > _MAX_RECENT:  # fold the recent entries into a new shared base
            base = {**base, **recent}
            recent = {}
        out._root, out._dirty, out._overlay, out._recent = self._root, dirty, base, recent
        return out

    def warm(self) -> None:
        """Build the root's GPU index now if no look-up has (off a decision's path): the
        maps derived from this one look GPUs up through it, whether or not this one was
        walked as a dict."""
        if self._root._owner is None:
            self._root._index()

    def _reroot(self, out: MergedCaps, dirty: frozenset[int]) -> bool:
        """Make ``out`` (derived from this map, ``dirty`` its replicas that may differ from
        the root's) the root by patching the root's index in place; the old root keeps
        an undo record of what changed. Only where every GPU of the parts involved is
        held by one part (then the patch is a few C-level passes per part) and the old
        root is still the newest of its index; returns whether it did."""
        root = self._root
        owner = root._owner
        if owner is None or root._next is not None:
            return False
        old_parts, new_parts = root.parts, out.parts
        with _REROOT:
            if root._next is not None:
                return False
            gone, came = [], []  # per dirty replica: its GPUs in the root's part / out's
            for i in dirty:
                old = old_parts.get(i)
                if old:
                    gpus = old.gpus if type(old) is UniformCaps else tuple(old)
                    if set(map(owner.get, gpus)) != {i}:
                        return False  # held by another part too (or not as indexed)
                    gone.append((gpus, i))
                new = new_parts.get(i)
                if new:
                    came.append((new.gpus if type(new) is UniformCaps else tuple(new), i))
            left = set(chain.from_iterable(g for g, _ in gone))
            added = list(chain.from_iterable(g for g, _ in came))
            arriving = set(added)
            fresh = arriving - left
            if len(arriving) != len(added) or not owner.keys().isdisjoint(fresh):
                return False  # a GPU in two new parts, or in a part that stays
            undo: dict = {}
            for gpus, i in gone:
                undo.update(dict.fromkeys(gpus, i))
            undo.update(dict.fromkeys(fresh, _ABSENT))
            root._next = (undo, out)  # before the patch: a reader that sees it reads undo
            for gpus, _ in gone:
                deque(map(owner.pop, gpus), 0)
            for gpus, i in came:
                owner.update(zip(gpus, repeat(i)))
            out._owner = owner
        return True

    def _root_get(self, gpu: object) -> int | tuple[int, ...] | None:
        """The root's index entry of ``gpu``, as this map's root had it (through the undo
        records of the roots that patched the index since)."""
        root = self._root
        if root._owner is None:
            root._index()
        while True:
            held = root._owner.get(gpu)  # type: ignore[union-attr]
            link = root._next  # read after the entry: set before any patch
            if link is None:
                return held
            undo, root = link
            was = undo.get(gpu, _UNCHANGED)
            if was is not _UNCHANGED:
                return None if was is _ABSENT else was

    def _index(self) -> dict[GpuKey, int | tuple[int, ...]]:
        """The root's GPU -> the replica holding it (all of them, ascending, for a GPU
        held by several parts)."""
        root = self._root
        if root._owner is None:
            owner: dict[GpuKey, int | tuple[int, ...]] = {}
            parts = root.parts
            for i in sorted(parts):
                owner.update(dict.fromkeys(parts[i], i))
            if len(owner) != sum(map(len, parts.values())):  # a GPU in several parts
                held: dict[GpuKey, list[int]] = {}
                for i in sorted(parts):
                    for g in parts[i]:
                        held.setdefault(g, []).append(i)
                owner.update((g, tuple(h)) for g, h in held.items() if len(h) > 1)
            root._owner = owner
        return root._owner

    def _holder(self, gpu: object) -> int | None:
        """The replica whose part gives ``gpu``'s cap (None: no part holds it)."""
        held = self._root_get(gpu)
        dirty = self._dirty
        if type(held) is tuple:
            best = max((i for i in held if i not in dirty), default=None)
        else:
            best = held if held not in dirty else None
        over = self._recent.get(gpu)  # type: ignore[call-overload]
        if over is None:
            over = self._overlay.get(gpu)  # type: ignore[call-overload]
        if over and (best is None or over[-1] > best):
            best = over[-1]
        return best

    def __getitem__(self, gpu: GpuKey) -> float:
        if self._dict is not None:
            return self._dict[gpu]
        i = self._holder(gpu)
        if i is None:
            raise KeyError(gpu)
        part = self.parts[i]
        # the holder's part holds the GPU (the index and the overlay say so)
        return part.watts if type(part) is UniformCaps else part[gpu]

    def get(self, gpu, default=None):
        """``_holder`` inlined for the common look-up (a commit asks for the caps of the
        GPUs of the replicas it changes, a few hundred)."""
        if self._dict is not None:
            return self._dict.get(gpu, default)
        root = self._root
        owner = root._owner
        held = (owner if owner is not None else self._index()).get(gpu)
        if root._next is not None:  # superseded: as this map's root had it
            held = self._root_get(gpu)
        if type(held) is tuple:
            i = self._holder(gpu)
        else:
            i = held if held not in self._dirty else None
            over = self._recent.get(gpu)
            if over is None:
                over = self._overlay.get(gpu)
            if over and (i is None or over[-1] > i):
                i = over[-1]
        if i is None:
            return default
        part = self.parts[i]
        return part.watts if type(part) is UniformCaps else part[gpu]

    def get_many(self, gpus: list[GpuKey]) -> list[float | None]:
        """``[self.get(g) for g in gpus]`` with the look-up inlined (a commit compares the
        caps of a changed rack's GPUs: a hundred or two method calls otherwise)."""
        if self._dict is not None:
            return list(map(self._dict.get, gpus))
        root = self._root
        owner = root._owner
        if owner is None:
            owner = self._index()
        entries = list(map(owner.get, gpus))
        if root._next is not None:  # superseded: as this map's root had it
            entries = list(map(self._root_get, gpus))
        dirty, recent_of, over_of, parts = self._dirty, self._recent.get, self._overlay.get, self.parts
        out: list[float | None] = []
        for gpu, held in zip(gpus, entries, strict=True):
            if type(held) is tuple:
                i = self._holder(gpu)
            else:
                i = held if held not in dirty else None
                over = recent_of(gpu)
                if over is None:
                    over = over_of(gpu)
                if over and (i is None or over[-1] > i):
                    i = over[-1]
            if i is None:
                out.append(None)
                continue
            part = parts[i]
            out.append(part.watts if type(part) is UniformCaps else part[gpu])
        return out

    def __contains__(self, gpu: object) -> bool:
        if self._dict is not None:
            return gpu in self._dict
        return self._holder(gpu) is not None

    def __iter__(self) -> Iterator[GpuKey]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        if self._root is self and self._next is None:
            return len(self._index())
        return len(self.as_dict())

    def keys(self):
        return self.as_dict().keys()

    def items(self):
        return self.as_dict().items()

    def values(self):
        return self.as_dict().values()

    def as_dict(self) -> dict[GpuKey, float]:
        """The caps as one dict (built once, on the first call: a whole-map walk)."""
        if self._dict is None:
            out: dict[GpuKey, float] = {}
            for i in sorted(self.parts):
                part = self.parts[i]
                if type(part) is UniformCaps:  # no per-GPU look-up of its watts
                    out.update(dict.fromkeys(part.gpus, part.watts))
                else:
                    out.update(part)
            self._dict = out
        return self._dict

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MergedCaps) and other.parts is self.parts:
            return True
        if isinstance(other, Mapping):
            return self.as_dict() == (other.as_dict() if isinstance(other, MergedCaps) else dict(other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"MergedCaps({self.as_dict()!r})"
