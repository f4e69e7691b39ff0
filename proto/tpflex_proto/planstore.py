"""Plan storage that scales with the change (DESIGN.md, etcd layout).

Generation ``g`` of job ``J``'s plan is stored as

- ``jobs/J/plan``: the header, a ``Plan`` with everything but the replicas and their GPUs'
  power caps, ``split`` set and ``stored_replicas`` = the number of replicas;
- ``jobs/J/assign/<gen>/<i>``: the replica at position ``i`` (a ``Plan`` holding that one
  ``ReplicaPlan``, the caps of its GPUs and the reasons that concern it), written only by
  the generations that change it: generation ``g``'s replica ``i`` is the part of the
  largest ``gen <= g``;
- ``jobs/J/history/<g>``: the header of generation ``g``; the parts the kept generations
  need are kept with them (:class:`PartIndex` says which ones may go).

So a generation writes O(what changed): the header keeps only the plan's own reasons
(suspended pins), not one line per degraded replica, which at 1% failed GPUs of 262,144
made it ~400 KB, written twice (plan and history) by every commit. Assembled, the bytes
are exactly the deterministic encoding of the whole ``Plan`` (fields 1-3, the replicas
in order, the caps sorted by GPU, field 6, the parts' reasons in part order then the
header's, fields 8-10), so every reader sees the plans it saw when one key held the whole
plan. A header without ``split`` is a whole plan (tests and tools may write one); a part
without reasons (as written before parts held them) leaves them all to its header.

Parts sort before the header (``assign`` < ``plan``) and a generation's parts are written
before its header (earlier in the same transaction, or in earlier ones), so a reader that
folds keys in revision and key order holds every part when the header arrives.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.wire import decode_varint as _varint

_HEAD = (1, 2, 3)
_REPLICAS, _CAPS, _REASONS = 4, 5, 7
_SPLIT_FIELDS = (11, 12)


def decode_plan(value: bytes, key: str) -> types_pb2.Plan:
    """Decode a plan with a top-level schema check only (a plan can hold 250k GPU refs)."""
    from google.protobuf import unknown_fields
    from google.protobuf.message import DecodeError

    plan = types_pb2.Plan()
    try:
        plan.ParseFromString(value)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise codec.MalformedValue(key, "Plan", str(exc)) from exc
    if len(unknown_fields.UnknownFieldSet(plan)):
        raise codec.MalformedValue(key, "Plan", "unknown fields")
    return plan


# ---- keys ----


@dataclass(frozen=True)
class PlanKey:
    """A key of the plan layout: kind is "header", "part" or "history"."""

    kind: str
    job: str
    generation: int = 0
    position: int = 0


_PLAN_KINDS = {keys.Kind.JOB_PLAN: "header", keys.Kind.JOB_HISTORY: "history", keys.Kind.JOB_ASSIGN: "part"}


def parse_key(key: str) -> PlanKey | None:
    """The plan-layout meaning of an etcd key; None for any other key."""
    k = keys.parse(key)
    kind = _PLAN_KINDS.get(k.kind) if k is not None else None
    if kind is None:
        return None
    return PlanKey(kind, k.name, k.number, k.position)


# ---- wire format (top-level fields only) ----


def fields(data: bytes) -> list[tuple[int, bytes]]:
    """(field number, the field's whole encoding) of each top-level field, in order.
    One-byte tags and lengths (a plan part's caps: 72 fields of a few dozen bytes) are
    read inline, without a call per varint."""
    out = []
    append = out.append
    pos, end = 0, len(data)
    while pos < end:
        start = pos
        tag = data[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _varint(data, pos)
        wire = tag & 7
        if wire == 2:
            if pos >= end:
                raise ValueError("truncated varint")
            size = data[pos]
            if size < 0x80:
                pos += 1 + size
            else:
                size, pos = _varint(data, pos)
                pos += size
        elif wire == 0:
            _, pos = _varint(data, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if pos > end:
            raise ValueError("truncated field")
        append((tag >> 3, data[start:pos]))
    return out


class Assembler:
    """Joins a header and its parts into the whole plan's bytes; remembers each cap's GPU
    (caps repeat across generations) so that a generation costs no cap decoding."""

    def __init__(self, max_cached: int = 500_000) -> None:
        self._gpu_of_cap: dict[bytes, tuple[str, int]] = {}
        self._max = max_cached

    def whole(self, header: bytes, parts: Sequence[bytes], kept: dict | None = None) -> bytes:
        """``kept``: one job's parsed parts of its previous call (the caller keeps it per
        job; this call replaces its content with this call's parts): a part seen then, the
        same bytes, is not split into fields again. A generation changes a few parts, so
        a reader of every generation (the REST process) splits those few, not the 30-odd
        of the whole plan with their caps (most of its CPU while idle under GPU churn)."""
        head, caps, low, high = [], [], [], []
        gpu = self._gpu
        for num, raw in fields(header):
            if num in _HEAD:
                head.append(raw)
            elif num == _CAPS:
                caps.append((gpu(raw), raw))
            elif num in _SPLIT_FIELDS or num == _REPLICAS:
                continue
            elif num < _REASONS:
                low.append(raw)
            else:
                high.append(raw)
        replicas, reasons = [], []
        now = {} if kept is not None else None
        for part in parts:
            pieces = kept.get(part) if kept is not None else None
            if pieces is None:
                pieces = self._pieces(part)
            if now is not None:
                now[part] = pieces
            replicas.extend(pieces[0])
            caps.extend(pieces[1])
            reasons.extend(pieces[2])
        if kept is not None:
            kept.clear()
            kept.update(now)
        caps.sort(key=_first)  # stable: caps of one GPU stay in header, then part order
        # the replicas' reasons (in part order) come before the header's own
        return b"".join([*head, *replicas, *(raw for _, raw in caps), *low, *reasons, *high])

    def _pieces(self, part: bytes) -> tuple[tuple[bytes, ...], tuple[tuple[tuple[str, int], bytes], ...],
                                             tuple[bytes, ...]]:
        """A part's replica fields, its caps with their GPUs and its reasons."""
        replicas, caps, reasons = [], [], []
        for num, raw in fields(part):
            if num == _REPLICAS:
                replicas.append(raw)
            elif num == _CAPS:
                caps.append((self._gpu(raw), raw))
            elif num == _REASONS:
                reasons.append(raw)
        return tuple(replicas), tuple(caps), tuple(reasons)

    def _gpu(self, raw: bytes) -> tuple[str, int]:
        gpu = self._gpu_of_cap.get(raw)
        if gpu is None:
            cap = types_pb2.Plan.FromString(raw).power_caps[0]
            gpu = (cap.gpu.node, cap.gpu.index)
            if len(self._gpu_of_cap) >= self._max:
                self._gpu_of_cap.clear()
            self._gpu_of_cap[raw] = gpu
        return gpu


_first = operator.itemgetter(0)


# ---- which parts exist, which generation needs which ----


@dataclass
class PartIndex:
    """The parts of one job in etcd: position -> generations present (ascending), and the
    parts the kept history no longer needs, by the generation whose commit may delete
    them. What a commit asks (``stale``, ``dead``, ``top_position``) costs O(positions
    with more than one part + generations), not O(positions)."""

    gens: dict[int, list[int]] = field(default_factory=dict)
    values: dict[tuple[int, int], bytes] = field(default_factory=dict)  # (gen, pos) -> part
    _per_gen: dict[int, int] = field(default_factory=dict, repr=False)  # generation -> parts
    _multi: set[int] = field(default_factory=set, repr=False)  # positions with 2+ parts
    _top: int = field(default=-1, repr=False)  # the largest position ever added
    # positions with 2+ values held (release() looks at these only)
    _many_values: set[int] = field(default_factory=set, repr=False)
    # (second-oldest generation, position) of the positions with 2+ parts: a position's
    # oldest part is dead once its second-oldest is kept no more (``dead``). An entry goes
    # stale when its position's parts change; it is checked, and dropped or pushed again
    # with its new key, when it comes up.
    _trimmable: list[tuple[int, int]] = field(default_factory=list, repr=False)

    def add(self, generation: int, position: int, value: bytes) -> None:
        got = self.gens.setdefault(position, [])
        if generation not in got:
            got.append(generation)
            got.sort()
            self._per_gen[generation] = self._per_gen.get(generation, 0) + 1
            if len(got) > 1:
                self._multi.add(position)
                heapq.heappush(self._trimmable, (got[1], position))
            self._top = max(self._top, position)
        self.values[(generation, position)] = value
        if len(got) > 1:
            self._many_values.add(position)

    def remove(self, generation: int, position: int) -> None:
        got = self.gens.get(position)
        if got is not None and generation in got:
            got.remove(generation)
            left = self._per_gen.pop(generation) - 1
            if left:
                self._per_gen[generation] = left
            if len(got) < 2:
                self._multi.discard(position)
            if not got:
                del self.gens[position]
                self._many_values.discard(position)
        self.values.pop((generation, position), None)

    def release(self, generation: int) -> None:
        """Drop the values no generation from ``generation`` on selects (a part with a
        newer one at or before ``generation`` at its position); their generations stay
        indexed (``stale``, ``dead``). For a reader of the current plan only, which never
        asks for an older generation again: the kept history's parts stay in etcd, not
        in its memory. O(positions holding 2+ values)."""
        for pos in list(self._many_values):
            gs = self.gens.get(pos, ())
            live = max((g for g in gs if g <= generation), default=0)
            held = 0
            for g in gs:
                if g < live:
                    self.values.pop((g, pos), None)
                elif (g, pos) in self.values:
                    held += 1
            if held < 2:
                self._many_values.discard(pos)

    def top_position(self) -> int:
        """An upper bound of the positions present (-1: none): the largest ever added."""
        return self._top if self.gens else -1

    def select(self, generation: int, count: int, key: str = "?") -> list[bytes]:
        """The parts of generation ``generation`` (``count`` replicas), in order; raises
        MalformedValue when one is missing."""
        out = []
        for pos in range(count):
            best = 0
            for g in self.gens.get(pos, ()):
                if g <= generation:
                    best = g
            value = self.values.get((best, pos)) if best else None
            if value is None:  # never written, or released (``release``)
                raise codec.MalformedValue(key, "Plan", f"replica {pos} of generation {generation} missing")
            out.append(value)
        return out

    def stale(self, generation: int) -> list[int]:
        """Generations above ``generation`` that have parts (a staged write that never
        committed); they must go before ``generation + 1`` is written."""
        return sorted(g for g in self._per_gen if g > generation)

    def dead(self, oldest_kept: int, count: int, limit: int) -> list[tuple[int, int]]:
        """Up to ``limit`` parts (gen, position) no kept generation (>= ``oldest_kept``)
        uses: a part with a newer one at or before ``oldest_kept``, or at a position no
        kept generation has (``count``: the most replicas any kept generation has). Only
        positions with several parts can hold the first kind; all are looked at only
        when a position may lie at or beyond ``count`` (a job that shrank)."""
        if self._top < count:
            return self._superseded(oldest_kept, limit)
        out: list[tuple[int, int]] = []
        for pos in self.gens:
            gs = self.gens[pos]
            if pos >= count:
                out.extend((g, pos) for g in gs if g <= oldest_kept)
            else:
                live = max((g for g in gs if g <= oldest_kept), default=0)
                out.extend((g, pos) for g in gs if g < live)
            if len(out) >= limit:
                break
        return sorted(out)[:limit]

    def _superseded(self, oldest_kept: int, limit: int) -> list[tuple[int, int]]:
        """``dead`` when every position is below the count: the parts with a newer one at
        or before ``oldest_kept``, from the positions whose second-oldest part is (the
        heap's first entries), O((their parts + stale entries) x log positions), not a
        walk of every position with several parts (thousands of degraded replicas)."""
        heap, gens = self._trimmable, self.gens
        out: list[tuple[int, int]] = []
        keep: set[tuple[int, int]] = set()  # current entries looked at: they stay
        while heap and heap[0][0] <= oldest_kept and len(out) < limit:
            entry = heapq.heappop(heap)
            key, pos = entry
            gs = gens.get(pos)
            if gs is None or len(gs) < 2 or entry in keep:
                continue  # stale (the parts went), or a duplicate of one looked at
            if gs[1] != key:  # its parts changed: back with the current key
                heapq.heappush(heap, (gs[1], pos))
                continue
            keep.add(entry)
            live = max(g for g in gs if g <= oldest_kept)
            out.extend((g, pos) for g in gs if g < live)
        for entry in keep:  # their parts go only when a commit deletes them (remove)
            heapq.heappush(heap, entry)
        return sorted(out)[:limit]


# ---- readers ----


def whole_plans(kvs: Iterable, assembler: Assembler | None = None) -> tuple[dict, dict]:
    """From the key-values of one consistent read (any order): each job's current plan and
    its kept generations (oldest first), as whole ``Plan`` messages. Malformed or
    incomplete plans raise MalformedValue."""
    assembler = assembler or Assembler()
    parts: dict[str, PartIndex] = {}
    headers: dict[str, bytes] = {}
    history: dict[str, dict[int, bytes]] = {}
    for kv in kvs:
        pk = parse_key(kv.key)
        if pk is None:
            continue
        if pk.kind == "part":
            parts.setdefault(pk.job, PartIndex()).add(pk.generation, pk.position, kv.value)
        elif pk.kind == "header":
            headers[pk.job] = kv.value
        else:
            history.setdefault(pk.job, {})[pk.generation] = kv.value
    current = {job: whole(v, parts.get(job), assembler, keys.job_plan(job)) for job, v in headers.items()}
    kept = {
        job: [whole(gens[g], parts.get(job), assembler, keys.job_plan_history(job, g)) for g in sorted(gens)]
        for job, gens in history.items()
    }
    return current, kept


def whole(value: bytes, parts: PartIndex | None, assembler: Assembler, key: str,
          kept: dict | None = None) -> types_pb2.Plan:
    """The whole plan of a stored header (or of a whole plan stored as such); ``kept``:
    the job's parsed parts (``Assembler.whole``)."""
    plan = decode_plan(value, key)
    if not plan.split:
        return plan
    chosen = (parts or PartIndex()).select(plan.generation, plan.stored_replicas, key)
    try:
        return decode_plan(assembler.whole(value, chosen, kept), key)
    except ValueError as exc:
        raise codec.MalformedValue(key, "Plan", str(exc)) from exc


def read_job(etcd, job: str) -> tuple[types_pb2.Plan | None, list[types_pb2.Plan]]:
    """The job's current plan (None: none) and kept generations, from one etcd read."""
    kvs, _ = etcd.get_prefix(keys.job_prefix(job))
    current, kept = whole_plans(kvs)
    return current.get(job), kept.get(job, [])


def read_plan(etcd, job: str) -> types_pb2.Plan | None:
    return read_job(etcd, job)[0]


class JobPlans:
    """One job's plans as its keys arrive (a consistent read, then watch events in
    revision order): parts are indexed and each header put gives the whole plan. Only the
    values the current plan and newer ones use are held (``PartIndex.release``)."""

    def __init__(self, job: str, assembler: Assembler | None = None) -> None:
        self.job = job
        self.parts = PartIndex()
        self._assembler = assembler or Assembler()

    def fold(self, key: str, value: bytes, deleted: bool = False) -> types_pb2.Plan | None:
        """The whole plan when ``key`` is the job's header put; None otherwise. Raises
        MalformedValue for a header it cannot assemble."""
        pk = parse_key(key)
        if pk is None or pk.job != self.job or pk.kind == "history":
            return None
        if pk.kind == "part":
            if deleted:
                self.parts.remove(pk.generation, pk.position)
            else:
                self.parts.add(pk.generation, pk.position, value)
            return None
        if deleted:
            return None
        plan = whole(value, self.parts, self._assembler, key)
        self.parts.release(plan.generation)  # the current plan's parts (and newer) stay
        return plan

    def fold_read(self, kvs: Iterable) -> types_pb2.Plan | None:
        """Fold a prefix read of the job (key order: parts before the header); the current
        plan or None."""
        current = None
        for kv in kvs:
            plan = self.fold(kv.key, kv.value)
            current = plan if plan is not None else current
        return current
