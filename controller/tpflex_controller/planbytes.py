"""Encoding of a plan for etcd without rebuilding unchanged replicas.

A plan of 1,024 replicas at TP 72 lists 73,728 GPUs; building that protobuf from scratch
on every generation costs tens of milliseconds. Protobuf encodes a repeated message field
as the concatenation of its elements, so the encoded ``Plan`` is
``head(fields 1-3) + replica_1 + ... + replica_n + cap_1 + ... + cap_m + tail(fields 6-10)``:
each replica's bytes are cached by its (immutable, hashable) assignment and each power
cap's by (GPU, watts), and the result is byte-for-byte the
deterministic encoding of ``convert.plan_to_proto`` (tested).

The caches are bounded LRUs: every failure or recovery makes new assignments and caps,
so the entries of superseded plans must leave (an unbounded or clear-when-100,000-full
cache kept each replaced assignment alive and grew the controller by tens of MB over a
10-minute load run). The limits cover the live plans of a large cluster; a miss only
costs building those bytes again.
"""

from __future__ import annotations

import struct
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from itertools import chain, repeat
from operator import is_

from tpflex_proto import agent_pb2, codec, types_pb2
from tpflex_proto.wire import encode_varint as _varint

from tpflex_controller import convert
from tpflex_controller.planner.caps import UniformCaps
from tpflex_controller.planner.model import (
    GpuKey,
    PlanResult,
    Policy,
    ReplicaAssignment,
    assembled,
    changed_since,
    moved,
    remember_moved,
)


def cap_wire(gpu: GpuKey, watts: float) -> bytes:
    """The encoding of ``Plan(power_caps=[PowerCap(gpu=GpuRef(node, index), cap_w=watts)])``
    written out (field 5, in it fields 1 and 2, in the GpuRef fields 1 and 2): a commit
    encodes a new cap for each GPU of a boosted stage. Through protobuf where a field
    would be left out (a zero or an empty name) or out of range."""
    node, index = gpu
    if not (watts > 0 and node and 0 <= index < 1 << 32):
        holder = types_pb2.Plan()
        holder.power_caps.add(gpu=types_pb2.GpuRef(node=node, index=index), cap_w=watts)
        return codec.encode(holder)
    name = node.encode()
    ref = b"\x0a" + _varint(len(name)) + name + (b"\x10" + _varint(index) if index else b"")
    cap = b"\x0a" + _varint(len(ref)) + ref + b"\x11" + _DOUBLE.pack(watts)
    return b"\x2a" + _varint(len(cap)) + cap


def cap_prefix(gpu: GpuKey) -> bytes | None:
    """``cap_wire(gpu, w)`` is ``cap_prefix(gpu) + struct.pack("<d", w)`` for every
    ``w > 0`` (the cap's length does not depend on its watts); None where it cannot be
    written out (``cap_wire`` goes through protobuf there)."""
    node, index = gpu
    if not (node and 0 <= index < 1 << 32):
        return None
    return _cap_prefix(_name_field(node), index)


def _name_field(node: str) -> bytes:
    """A GpuRef's field 1 (the node's name), written out."""
    name = node.encode()
    return b"\x0a" + _varint(len(name)) + name


def _cap_prefix(name_field: bytes, index: int) -> bytes:
    """``cap_prefix((node, index))`` from the node's ``_name_field`` (0 <= index < 2**32)."""
    ref = name_field + _INDEX_FIELD[index] if index < 128 else name_field + b"\x10" + _varint(index)
    n = len(ref)
    if n < 0x7F - 11:  # the ref's and the cap's lengths are one byte each
        return b"\x2a" + _ONE_BYTE[n + 11] + b"\x0a" + _ONE_BYTE[n] + ref + b"\x11"
    head = b"\x0a" + _varint(n) + ref + b"\x11"
    return b"\x2a" + _varint(len(head) + 8) + head


def replica_wire(r: ReplicaAssignment) -> bytes | None:
    """The encoding of ``Plan(replicas=[convert's ReplicaPlan of r])`` written out (field
    4, in it ReplicaPlan fields 1-7, each StagePlan's fields 1-4 and GpuRef 1-2), as the
    deterministic protobuf encoding lays it out: fields in number order, zero values and
    empty strings left out. None where a value is out of a field's range, or a zero
    throughput (its sign), so the caller goes through protobuf: a commit encodes the
    71-odd GPU refs of every replica it changes (68 against 113 us through message objects)."""
    state = _STATE_NUMBER.get(r.state)
    if state is None or not _u32(r.index, r.tp_degree, r.local_batch) or not r.relative_throughput:
        return None
    out = [b"\x08" + _varint(r.index)] if r.index else []
    if state:
        out.append(b"\x10" + _varint(state))
    refs: dict[str, bytes] = {}
    for st in r.stages:
        if not _u32(st.tp_degree, st.spec_stage):
            return None
        body = []
        if st.rack:
            name = st.rack.encode()
            body.append(b"\x0a" + _varint(len(name)) + name)
        if st.tp_degree:
            body.append(b"\x10" + _varint(st.tp_degree))
        for node, index in st.gpus:
            head = refs.get(node)
            if head is None:
                name = node.encode()
                head = refs[node] = b"\x0a" + _varint(len(name)) + name if name else b""
            if not index:
                body.append(b"\x1a" + _varint(len(head)) + head)
            elif 0 < index < 1 << 32:
                ref = head + b"\x10" + _varint(index)
                body.append(b"\x1a" + _varint(len(ref)) + ref)
            else:
                return None
        if st.spec_stage:
            body.append(b"\x20" + _varint(st.spec_stage))
        stage = b"".join(body)
        out.append(b"\x1a" + _varint(len(stage)) + stage)
    if r.tp_degree:
        out.append(b"\x20" + _varint(r.tp_degree))
    if r.local_batch:
        out.append(b"\x28" + _varint(r.local_batch))
    out.append(b"\x31" + _DOUBLE.pack(r.relative_throughput))
    if r.reason:
        reason = r.reason.encode()
        out.append(b"\x3a" + _varint(len(reason)) + reason)
    replica = b"".join(out)
    return b"\x22" + _varint(len(replica)) + replica


def power_plan_wire(node: str, generation: int, caps: Iterable[tuple[int, float]]) -> bytes:
    """``codec.encode(NodePowerPlan(node, generation, caps=[PowerCap(GpuRef(node, i), w)]))``
    written out (fields 1-3; each cap's GpuRef fields 1-2 and cap_w), through protobuf
    where a value is out of range or a cap is zero watts."""
    bodies = _cap_bodies(node, caps)
    if bodies is None or not 0 <= generation < 1 << 64:
        return codec.encode(types_pb2.NodePowerPlan(node=node, generation=generation, caps=[
            types_pb2.PowerCap(gpu=types_pb2.GpuRef(node=node, index=i), cap_w=w) for i, w in caps]))
    return _power_plan_head(node, generation) + b"".join(
        [b"\x1a" + _varint(len(body)) + body for body in bodies])


def _power_plan_head(node: str, generation: int) -> bytes:
    """A NodePowerPlan's fields 1-2 (node, generation), written out."""
    name = node.encode()
    out = b"\x0a" + _varint(len(name)) + name if name else b""
    return out + b"\x10" + _varint(generation) if generation else out


def apply_request_wire(node: str, generation: int, caps: Iterable[tuple[int, float]]) -> bytes:
    """``ApplyPowerPlanRequest(generation, caps=[PowerCap(GpuRef(node, i), w)])`` encoded
    (fields 1-2), written out as ``power_plan_wire``: the agent's copy of the same plan."""
    bodies = _cap_bodies(node, caps)
    if bodies is None or not 0 <= generation < 1 << 64:
        return agent_pb2.ApplyPowerPlanRequest(generation=generation, caps=[
            types_pb2.PowerCap(gpu=types_pb2.GpuRef(node=node, index=i), cap_w=w) for i, w in caps
        ]).SerializeToString(deterministic=True)
    out = [b"\x08" + _varint(generation)] if generation else []
    out.extend(b"\x12" + _varint(len(body)) + body for body in bodies)
    return b"".join(out)


def _cap_bodies(node: str, caps: Iterable[tuple[int, float]]) -> list[bytes] | None:
    """Each cap's PowerCap fields (GpuRef, cap_w); None where protobuf must build them."""
    name = node.encode()
    head = b"\x0a" + _varint(len(name)) + name if name else b""
    out = []
    packed: dict[float, bytes] = {}
    for index, watts in caps:
        if not (type(index) is int and 0 <= index < 1 << 32) or watts == 0 or type(watts) not in (float, int):
            return None
        ref = head + b"\x10" + _varint(index) if index else head
        w = packed.get(watts)
        if w is None:
            w = packed[watts] = _DOUBLE.pack(watts)
        out.append(b"\x0a" + _varint(len(ref)) + ref + b"\x11" + w)
    return out


def _u32(*values: int) -> bool:
    return all(type(v) is int and 0 <= v < 1 << 32 for v in values)


_STATE_NUMBER = {state: int(number) for state, number in convert._REPLICA_STATE.items()}


_DOUBLE = struct.Struct("<d")
_ONE_BYTE = tuple(bytes((n,)) for n in range(0x80))
# a GpuRef's field 2 (its index) for the small indices, left out for 0 (proto3's default)
_INDEX_FIELD = (b"", *(b"\x10" + _ONE_BYTE[n] for n in range(1, 0x80)))


class Lru:
    """A mapping of at most ``limit`` entries; a look-up refreshes its entry, an
    insertion beyond the limit drops the least recently used one."""

    __slots__ = ("_d", "limit")

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"an LRU needs room for an entry, got limit={limit}")
        self._d: OrderedDict = OrderedDict()
        self.limit = limit

    def get(self, key: Hashable):
        value = self._d.get(key)
        if value is not None:
            self._d.move_to_end(key)
        return value

    def setdefault(self, key: Hashable, make: Callable[[], object]):
        """``get(key)``, or a new entry of ``make()`` (put) where there is none."""
        d = self._d
        value = d.get(key)
        if value is not None:
            d.move_to_end(key)
            return value
        value = d[key] = make()
        if len(d) > self.limit:
            d.popitem(last=False)
        return value

    def put(self, key: Hashable, value) -> None:
        d = self._d
        d[key] = value
        d.move_to_end(key)
        if len(d) > self.limit:
            d.popitem(last=False)

    def __len__(self) -> int:
        return len(self._d)


@dataclass(frozen=True)
class _Split:
    result: PlanResult
    replicas: tuple[ReplicaAssignment, ...]
    cap_parts: Mapping[int, Mapping[GpuKey, float]]
    parts: list[bytes]
    reasons: Mapping[int, tuple[str, ...]]


def reasons_wire(lines: Iterable[str]) -> bytes:
    """The encoding of ``Plan(reasons=lines)`` (field 7, one length-delimited entry per
    line) written out."""
    out = []
    for line in lines:
        data = line.encode()
        out.append(b"\x3a" + _varint(len(data)) + data)
    return b"".join(out)


def _reason_parts(result: PlanResult) -> Mapping[int, tuple[str, ...]] | None:
    """The result's reasons by replica when they can go with the replicas' parts: every
    key a position of the plan and the lines, in key order, the first of ``reasons``
    (a PlanResult built elsewhere than the planner may not keep that; its reasons then
    all go in the header). O(replicas with reasons), compared in C."""
    said = result.reason_parts
    if said is None:
        return None
    if not said or assembled(result):  # the planner built its reasons so (model.remember_changed)
        return said
    order = sorted(said)
    if order[0] < 0 or order[-1] >= len(result.replicas):
        return None
    lines = list(chain.from_iterable(map(said.__getitem__, order)))
    if len(lines) > len(result.reasons) or not all(map(is_, lines, result.reasons)):
        return None
    return said


class PlanEncoder:
    def __init__(self, max_replicas: int = 4_096, max_caps: int = 32_768) -> None:
        # by identity first (the planner reuses its memoised healthy assignments), then by
        # value; each identity entry keeps its key alive so that an id is never reused
        self._by_id = Lru(max_replicas)  # id -> (ReplicaAssignment, bytes)
        self._replicas = Lru(max_replicas)  # ReplicaAssignment -> bytes
        # node -> {GPU index: cap_prefix} (a boost's watts change with every failure; the
        # GPU's part of the cap's bytes does not), for about ``max_caps`` GPUs (4 a node)
        self._caps = Lru(max(1, max_caps // 4))
        # job -> (replicas of its last split, GPU -> position): see _positions
        self._layout: dict[str, tuple[tuple[ReplicaAssignment, ...], dict[GpuKey, int]]] = {}
        # jobs where a GPU was claimed by two positions (then caps go by the table)
        self._shared: set[str] = set()
        self._last: dict[str, _Split] = {}  # job -> its last split by cap parts

    def forget(self, job: str) -> None:
        """Drop what is kept of a deleted job's last plan."""
        self._layout.pop(job, None)
        self._shared.discard(job)
        self._last.pop(job, None)

    def encode(self, result: PlanResult, generation: int, *, cause: str = "", now: float = 0.0) -> bytes:
        bare = PlanResult(
            job=result.job,
            policy=result.policy,
            replicas=(),
            power_caps={},
            expected_throughput_ratio=result.expected_throughput_ratio,
            reasons=result.reasons,
            suspended_pins=result.suspended_pins,
        )
        whole = convert.plan_to_proto(bare, generation, cause=cause, now=now)
        head = types_pb2.Plan(job=whole.job, generation=whole.generation, policy=whole.policy)
        whole.ClearField("job")
        whole.ClearField("generation")
        whole.ClearField("policy")
        parts = [codec.encode(head)]
        parts.extend(self._replica_bytes(r) for r in result.replicas)
        caps = result.power_caps
        parts.extend(self._cap_bytes(gpu, caps[gpu]) for gpu in sorted(caps))
        parts.append(codec.encode(whole))
        return b"".join(parts)

    def split(
        self, result: PlanResult, generation: int, *, cause: str = "", now: float = 0.0
    ) -> tuple[bytes, list[bytes]]:
        """The stored form of a plan (tpflex_proto.planstore): the header and one part per
        replica (its ReplicaPlan, the caps of its GPUs and its reasons). Unchanged replicas
        give the same bytes objects as last time; O(replicas changed since the job's last
        split + caps + the plan's own reasons)."""
        positions = self._positions(result)
        caps = result.power_caps
        said = _reason_parts(result)
        own = result.reasons[sum(map(len, said.values())):] if said is not None else result.reasons
        if result.cap_parts is not None and result.job not in self._shared:
            parts = self._parts_by_replica(result, said or {})
            return self._header(result, {}, own, len(parts), generation, cause, now), parts
        self._last.pop(result.job, None)
        by_pos: dict[int, list[GpuKey]] = {}
        outside: list[GpuKey] = []
        for gpu in caps:
            pos = positions.get(gpu)
            if pos is None:
                outside.append(gpu)
            else:
                by_pos.setdefault(pos, []).append(gpu)
        parts = []
        for i, r in enumerate(result.replicas):
            data = self._replica_bytes(r)
            mine = by_pos.get(i)
            if mine:
                data = data + b"".join(self._cap_bytes(g, caps[g]) for g in sorted(mine))
            lines = said.get(i) if said is not None else None
            if lines:
                data = data + reasons_wire(lines)
            parts.append(data)
        header = self._header(result, {g: caps[g] for g in outside}, own, len(parts), generation, cause, now)
        return header, parts

    def _parts_by_replica(self, result: PlanResult, said: Mapping[int, tuple[str, ...]]) -> list[bytes]:
        """The parts from the planner's cap and reason parts: with no GPU held by two
        replicas, the caps stored with a replica are exactly its cap part (the GPUs it
        uses), so a part is rebuilt only where the replica, its cap part or its reasons
        are not the last split's."""
        cap_parts = result.cap_parts or {}
        last = self._last.get(result.job)
        if last is None or len(last.replicas) != len(result.replicas):
            todo: Iterable[int] = range(len(result.replicas))
            parts: list[bytes] = [b""] * len(result.replicas)
        else:
            # the planner says what it changed; the last split and this one describe
            # their replicas by their own reason parts (else a kept part may lack them)
            hint = changed_since(last.result, result)
            if hint is not None and said is result.reason_parts and last.reasons is last.result.reason_parts:
                todo = hint
            else:
                old, was = last.cap_parts, last.reasons
                todo = sorted(
                    {*moved(last.replicas, result.replicas),
                     *(i for i in old.keys() | cap_parts.keys() if old.get(i) is not cap_parts.get(i)),
                     *(i for i in was.keys() | said.keys() if was.get(i) is not said.get(i))}
                )
            parts = list(last.parts)
        for i in todo:
            mine = cap_parts.get(i)
            data = self._replica_bytes(result.replicas[i])
            if type(mine) is UniformCaps:  # one watts for all: no per-GPU look-up
                data = data + self._uniform_caps(sorted(mine.gpus), mine.watts)
            elif mine:
                data = data + b"".join(self._cap_bytes(g, mine[g]) for g in sorted(mine))
            lines = said.get(i)
            if lines:
                data = data + reasons_wire(lines)
            parts[i] = data
        if last is not None and len(last.parts) == len(parts):
            remember_moved(last.parts, parts, todo)  # the others are the last split's objects
        self._last[result.job] = _Split(result, result.replicas, cap_parts, parts, said)
        return parts

    def _header(
        self, result: PlanResult, caps: dict[GpuKey, float], reasons: tuple[str, ...], count: int,
        generation: int, cause: str, now: float
    ) -> bytes:
        bare = PlanResult(
            job=result.job,
            policy=result.policy,
            replicas=(),
            power_caps=caps,
            expected_throughput_ratio=result.expected_throughput_ratio,
            reasons=reasons,
            suspended_pins=result.suspended_pins,
        )
        header = convert.plan_to_proto(bare, generation, cause=cause, now=now)
        header.split = True
        header.stored_replicas = count
        return codec.encode(header)

    def _positions(self, result: PlanResult) -> dict[GpuKey, int]:
        """GPU -> position of the replica holding it, kept per job across generations and
        updated for the replicas that changed."""
        last, table = self._layout.get(result.job, ((), {}))
        new = result.replicas
        if len(last) != len(new):
            last, table = (), {}
            self._shared.discard(result.job)
        changed = moved(last, new) if last else range(len(new))
        for i in changed if last else ():  # first let go of what the changed ones held
            for st in last[i].stages:
                gs = st.gpus
                if set(map(table.get, gs)) == {i}:  # all its own (the usual case): in C
                    deque(map(table.pop, gs, repeat(None)), 0)
                    continue
                for g in gs:
                    if table.get(g) == i:
                        del table[g]
        for i in changed:
            for st in new[i].stages:
                gs = st.gpus
                if table.keys().isdisjoint(gs) and len(set(gs)) == len(gs):  # in C
                    table.update(zip(gs, repeat(i)))
                    continue
                for g in gs:
                    if table.setdefault(g, i) != i:
                        # held by another position too: caps go by this table from now on
                        self._shared.add(result.job)
                        table[g] = i
        self._layout[result.job] = (new, table)
        return table

    def _cap_bytes(self, gpu: GpuKey, watts: float) -> bytes:
        prefix = self._prefix(gpu) if watts > 0 else None
        return cap_wire(gpu, watts) if prefix is None else prefix + _DOUBLE.pack(watts)

    def _uniform_caps(self, gpus: list[GpuKey], watts: float) -> bytes:
        """The caps of ``gpus`` (in this order), all at ``watts``."""
        if not watts > 0:
            return b"".join([cap_wire(g, watts) for g in gpus])
        w = _DOUBLE.pack(watts)
        prefixes = []
        last, table = None, {}
        name = b""
        for gpu in gpus:  # a rack's GPUs, node by node: one look-up per node
            node, index = gpu
            if node != last:
                last, table, name = node, self._node_prefixes(node), b""
            p = table.get(index)
            if p is None:
                if not (node and type(index) is int and 0 <= index < 1 << 32):
                    return b"".join([cap_wire(g, watts) for g in gpus])
                name = name or _name_field(node)
                p = table[index] = _cap_prefix(name, index)
            prefixes.append(p)
        return w.join(prefixes) + w

    def _prefix(self, gpu: GpuKey) -> bytes | None:
        table = self._node_prefixes(gpu[0])
        data = table.get(gpu[1])
        if data is None:
            data = cap_prefix(gpu)
            if data is not None:
                table[gpu[1]] = data
        return data

    def power_wire(self, node: str, generation: int, caps: tuple[tuple[int, float], ...]) -> bytes:
        """``power_plan_wire(node, generation, caps)`` (a node's ``power/<node>`` value),
        each cap's GPU part taken from the cap prefixes kept here: the commit that boosts a
        rack has just written the same GPUs' caps into the replica's part (a cap's
        ``PowerCap`` bytes are the same in a Plan and a NodePowerPlan, under another tag)."""
        if not (node and 0 <= generation < 1 << 64):
            return power_plan_wire(node, generation, caps)
        table = self._node_prefixes(node)
        heads = []
        for index, watts in caps:
            if not (type(index) is int and 0 <= index < 1 << 32) or watts == 0 or type(watts) not in (float, int):
                return power_plan_wire(node, generation, caps)
            p = table.get(index)
            if p is None:
                p = table[index] = cap_prefix((node, index))
            heads.append(p)
        out = _power_plan_head(node, generation)
        if not heads:
            return out
        first = caps[0][1]
        if all(w == first for _, w in caps):  # a boosted node: one watts for all its GPUs
            w = _DOUBLE.pack(first)
            return out + (w + b"\x1a").join([p[1:] for p in heads]).join((b"\x1a", w))
        return out + b"".join([b"\x1a" + p[1:] + _DOUBLE.pack(c[1]) for p, c in zip(heads, caps, strict=True)])

    def _node_prefixes(self, node: str) -> dict[int, bytes]:
        return self._caps.setdefault(node, dict)

    def _replica_bytes(self, replica: ReplicaAssignment) -> bytes:
        hit = self._by_id.get(id(replica))
        if hit is not None and hit[0] is replica:
            return hit[1]
        data = self._replicas.get(replica)
        if data is None:
            data = self._build(replica)
        self._by_id.put(id(replica), (replica, data))
        return data

    def _build(self, replica: ReplicaAssignment) -> bytes:
        data = replica_wire(replica)
        if data is not None:
            self._replicas.put(replica, data)
            return data
        one = PlanResult(
            job="",
            policy=Policy.NTP_PW,
            replicas=(replica,),
            power_caps={},
            expected_throughput_ratio=0.0,
            reasons=(),
        )
        holder = types_pb2.Plan()
        holder.replicas.append(convert.plan_to_proto(one, 0).replicas[0])
        data = codec.encode(holder)
        self._replicas.put(replica, data)
        return data
