"""The tables of the REST API's view (``ApiStateCache``), keyed for O(1) lookups, and how
an informer change record is folded into them. Mutated only by the informer's thread."""

from __future__ import annotations

import itertools
import logging

from google.protobuf.message import Message
from tpflex_proto import codec, keys, planstore, types_pb2
from tpflex_proto.etcd import KeyValue
from tpflex_proto.informer import Change as KeyChange
from tpflex_proto.keys import Kind as KeyKind

from tpflex_controller.store import (
    ASSEMBLER,
    Snapshot,
    apply_kv,
    decode_or_skip,
    fold_plan_key,
)

log = logging.getLogger(__name__)

_NODE_KEYS = frozenset({KeyKind.NODE, KeyKind.HEALTH, KeyKind.GPU_OVERRIDE, KeyKind.GPU_HOLD})
_JOB_KEYS = frozenset({KeyKind.JOB_SPEC, KeyKind.JOB_PLAN, KeyKind.JOB_HISTORY, KeyKind.JOB_ASSIGN,
                       KeyKind.JOB_ACK, KeyKind.JOB_OVERRIDE})
_PLAN_KEYS = frozenset({KeyKind.JOB_PLAN, KeyKind.JOB_ASSIGN})
_epochs = itertools.count(1)


class Tables:
    """Everything the API reads, keyed for O(1) lookups; mutated only by the feeder."""

    def __init__(self, revision: int = 0) -> None:
        self.epoch = next(_epochs)  # a fresh table set invalidates every rendered row
        self.node_ver: dict[str, int] = {}  # bumped when a record a node's rows derive from changes
        self.names_ver = 0  # bumped when the set of known nodes may have changed
        self._ver = 0  # bumped when any node's record (or a rack) changes
        self.dirty: set[str] = set()  # nodes touched since the NodeIndex last looked
        self.job_ver: dict[str, int] = {}  # bumped when a record of the job changes
        self.jobs_ver = 0  # bumped when any job's record changes
        self.snap = Snapshot(revision=revision)
        self.node_rack: dict[str, str] = {}  # rack members -> rack (registrations add theirs)
        self.node_overrides: dict[str, set[int]] = {}  # node -> GPU indices with an override or hold
        self.acks: dict[str, dict[int, types_pb2.Ack]] = {}
        self.events: dict[int, types_pb2.Event] = {}
        self.leader: types_pb2.LeaderRecord | None = None
        self.leader_present = False
        # per job, the parts of its last assembled plan split into fields (planstore's
        # Assembler.whole(kept=)): a commit splits only the parts it wrote
        self.plan_pieces: dict[str, dict] = {}

    def fold_change(self, c: KeyChange, assembled: dict | None = None, i: int = 0) -> None:
        """One informer change record (decoded there; a malformed value was logged there
        and keeps what the tables had, except that a leader key still means a leader).
        ``assembled``: what :meth:`assemble_plans` made of the batch (``i``: the change's
        position in it); plan keys then only store the whole plan assembled there."""
        kind = c.parsed.kind if c.parsed is not None else None
        if kind is KeyKind.POWER:
            return  # the API shows no power plans: not even decoded
        if assembled is not None and kind in _PLAN_KEYS:
            self.jobs_ver += 1
            self.job_ver[c.parsed.name] = self.jobs_ver
            if kind is KeyKind.JOB_PLAN:
                if c.deleted:
                    self.snap.plans.pop(c.parsed.name, None)
                elif assembled.get(i) is not None:  # None: malformed, the old plan stays
                    self.snap.plans[c.parsed.name] = assembled[i]
            return
        if c.malformed and kind is not KeyKind.LEADER:
            return
        self.fold(c.key_value(), c.deleted, c.msg)

    def assemble_plans(self, changes) -> dict[int, types_pb2.Plan | None]:
        """The costly part of folding a batch with plan commits (decoding a job's whole
        plan, every GPU and cap), done before the readers' lock is taken: the feeder
        thread is the tables' only writer, and readers never look at plan parts. Indexes
        the batch's plan parts (in order) and assembles the whole plan of each new plan
        header; returns {position in ``changes``: the plan, None when malformed}, for
        :meth:`fold_change` to store under the lock."""
        out: dict[int, types_pb2.Plan | None] = {}
        snap = self.snap
        for i, c in enumerate(changes):
            k = c.parsed
            if k is None or k.kind not in _PLAN_KEYS:
                continue
            if k.kind is KeyKind.JOB_ASSIGN:
                pk = planstore.PlanKey("part", k.name, k.number, k.position)
                fold_plan_key(snap, pk, c.key_value(), c.deleted)
            elif c.deleted:
                snap.plan_parts.pop(k.name, None)
                self.plan_pieces.pop(k.name, None)
            else:
                try:
                    out[i] = planstore.whole(c.value, snap.plan_parts.get(k.name), ASSEMBLER, c.key,
                                             self.plan_pieces.setdefault(k.name, {}))
                except codec.MalformedValue as exc:
                    log.warning("skipping malformed etcd value key=%s error=%s", c.key, exc)
                    out[i] = None
        return out

    def fold(self, kv: KeyValue, deleted: bool, msg: Message | None = None) -> None:
        k = keys.parse(kv.key)
        kind = k.kind if k is not None else None
        if kind in _JOB_KEYS:
            self.jobs_ver += 1
            self.job_ver[k.name] = self.jobs_ver
        elif kind in _NODE_KEYS:
            self._touch(k.name)
            if kind is KeyKind.NODE:
                self._fold_node(k.name, kv, deleted, msg)
                return
        if kind is KeyKind.LEADER:
            self._fold_leader(kv, deleted, msg)
        elif kind is KeyKind.EVENT:
            _fold_int(self.events, k.number, types_pb2.Event, kv, deleted, msg)
        elif kind is KeyKind.RACK:
            old = self.snap.racks.get(k.name)
            apply_kv(self.snap, kv, deleted, msg)
            self._index_rack(k.name, old)
        elif kind in (KeyKind.GPU_OVERRIDE, KeyKind.GPU_HOLD):
            apply_kv(self.snap, kv, deleted, msg)
            self._index_override(k.name, k.number)
        elif kind is KeyKind.JOB_ACK:
            _fold_int(self.acks.setdefault(k.name, {}), k.number, types_pb2.Ack, kv, deleted, msg)
        elif k is None and not deleted and (kv.key.startswith(keys.EVENTS) or "/acks/" in kv.key):
            log.warning("skipping malformed etcd key key=%s", kv.key)
        else:
            apply_kv(self.snap, kv, deleted, msg)

    def _fold_node(self, name: str, kv: KeyValue, deleted: bool, msg: Message | None) -> None:
        old = self.snap.nodes.get(name)
        apply_kv(self.snap, kv, deleted, msg)
        new = self.snap.nodes.get(name)
        if (old is None) != (new is None) or (old is not None and old.rack != new.rack):
            self.names_ver += 1  # a node registers, goes, or names another rack

    def _fold_leader(self, kv: KeyValue, deleted: bool, msg: Message | None = None) -> None:
        self.leader_present = not deleted
        if deleted:
            self.leader = None
        else:
            self.leader = msg if msg is not None else decode_or_skip(types_pb2.LeaderRecord, kv)
        if self.leader_present and self.leader is None:  # unreadable, but a leader is elected
            self.leader = types_pb2.LeaderRecord(id="<unreadable>")

    def _index_rack(self, name: str, old: types_pb2.Rack | None) -> None:
        self.names_ver += 1
        for n in old.nodes if old is not None else ():
            self._touch(n)
            if self.node_rack.get(n) == name:
                del self.node_rack[n]
        new = self.snap.racks.get(name)
        for n in new.nodes if new is not None else ():
            self._touch(n)
            self.node_rack[n] = name
        for reg in self.snap.nodes.values():  # registered outside any rack's list, naming it
            if reg.rack == name and reg.name not in self.node_rack:
                self._touch(reg.name)

    def _touch(self, node: str) -> None:
        self._ver += 1
        self.node_ver[node] = self._ver
        self.dirty.add(node)

    def version(self, resource: str, name: str) -> tuple:
        """What a response about ``resource`` renders changes only when this does:
        ``job`` (a job's spec, plan, acks, override), ``node`` (a node's records or its
        rack), ``cluster`` (any node or rack), ``jobs`` (any job), ``all`` (anything)."""
        if resource == "job":
            return (self.epoch, self.job_ver.get(name, 0))
        if resource == "node":
            return (self.epoch, self.node_ver.get(name, 0))
        if resource == "cluster":
            return (self.epoch, self._ver, self.names_ver)
        if resource == "jobs":
            return (self.epoch, self.jobs_ver)
        return (self.epoch, self.snap.revision)

    def _index_override(self, node: str, index: int) -> None:
        if (node, index) in self.snap.gpu_overrides or (node, index) in self.snap.gpu_holds:
            self.node_overrides.setdefault(node, set()).add(index)
        else:
            self.node_overrides.get(node, set()).discard(index)


def _fold_int(table: dict, number: int, cls, kv: KeyValue, deleted: bool, msg=None) -> None:
    if deleted:
        table.pop(number, None)
        return
    if msg is None:
        msg = decode_or_skip(cls, kv)
    if msg is not None:
        table[number] = msg


def node_subset(snap: Snapshot, node: str, rack: types_pb2.Rack | None,
                override_indices: set[int]) -> Snapshot:
    """The part of ``snap`` one node's views need: its rack, registration, health and
    GPU overrides (GPU states depend only on the node's own records)."""
    out = Snapshot(revision=snap.revision)
    if rack is not None:
        out.racks[rack.name] = rack
    for src, dst in ((snap.nodes, out.nodes), (snap.health, out.health)):
        if node in src:
            dst[node] = src[node]
    for idx in override_indices:
        o = snap.gpu_overrides.get((node, idx))
        if o is not None:
            out.gpu_overrides[(node, idx)] = o
        hold = snap.gpu_holds.get((node, idx))
        if hold is not None:
            out.gpu_holds[(node, idx)] = hold
    return out
