"""Typed access to the controller's state in etcd (key layout in ``tpflex_proto.keys``).

Reads decode with the shared codec; a malformed value written by something else is logged
and skipped, never raised from a prefix read. Leader-only writes (plans, power, events)
are *not* here: they go through the fenced transactions of ``election.LeaderSession``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

from google.protobuf.message import Message
from tpflex_proto import codec, keys, planstore, types_pb2
from tpflex_proto.etcd import Cmp, Etcd, KeyValue, Op
from tpflex_proto.keys import Kind

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)


def decode_or_skip(cls: type[M], kv: KeyValue) -> M | None:
    try:
        return codec.decode(cls, kv.value, kv.key)
    except codec.MalformedValue as exc:
        log.warning("skipping malformed etcd value key=%s error=%s", kv.key, exc)
        return None


class Updated(NamedTuple, Generic[M]):
    """What :meth:`Store.update` did: the value before and after, and the etcd revision
    that holds ``new`` (the write's; the key's mod revision when nothing was written; 0 for
    a key that stays absent). A reader waits for ``revision`` to read its own write."""

    old: M | None
    new: M | None
    revision: int


class UpdateConflict(Exception):
    """A compare-and-swap kept losing to concurrent writers of the same key."""


class RequiredKeyGone(Exception):
    """:meth:`Store.update` with ``requires``: that key was absent at the write."""


def _decode_all(cls: type[M], kvs: Iterable[KeyValue], prefix: str) -> dict[str, M]:
    out: dict[str, M] = {}
    for kv in kvs:
        msg = decode_or_skip(cls, kv)
        if msg is not None:
            out[kv.key[len(prefix):]] = msg
    return out


@dataclass
class Snapshot:
    """Everything the planner needs, read at one etcd revision."""

    revision: int = 0
    racks: dict[str, types_pb2.Rack] = field(default_factory=dict)
    nodes: dict[str, types_pb2.Node] = field(default_factory=dict)
    health: dict[str, types_pb2.NodeHealth] = field(default_factory=dict)
    jobs: dict[str, types_pb2.JobSpec] = field(default_factory=dict)
    plans: dict[str, types_pb2.Plan] = field(default_factory=dict)  # whole plans
    # the stored replica parts of the plans (tpflex_proto.planstore), by job
    plan_parts: dict[str, planstore.PartIndex] = field(default_factory=dict)
    gpu_overrides: dict[tuple[str, int], types_pb2.GpuOverride] = field(default_factory=dict)
    job_overrides: dict[str, types_pb2.JobOverride] = field(default_factory=dict)
    # the leader's flap damping: a GPU with a hold counts as failed (damping.py)
    gpu_holds: dict[tuple[str, int], types_pb2.GpuHold] = field(default_factory=dict)


class Store:
    def __init__(self, etcd: Etcd) -> None:
        self.etcd = etcd

    # ---- whole-state read ----

    def snapshot(self) -> Snapshot:
        """Read the whole ``/tpflex/v1/`` tree once (one range read, one revision)."""
        kvs, rev = self.etcd.get_prefix(keys.PREFIX)
        snap = Snapshot(revision=rev)
        for kv in kvs:
            apply_kv(snap, kv)
        return snap

    # ---- single reads ----

    def _get(self, cls: type[M], key: str) -> M | None:
        kv = self.etcd.get(key)
        return decode_or_skip(cls, kv) if kv is not None else None

    def rack(self, name: str) -> types_pb2.Rack | None:
        return self._get(types_pb2.Rack, keys.rack(name))

    def racks(self) -> dict[str, types_pb2.Rack]:
        kvs, _ = self.etcd.get_prefix(keys.RACKS)
        return _decode_all(types_pb2.Rack, kvs, keys.RACKS)

    def nodes(self) -> dict[str, types_pb2.Node]:
        kvs, _ = self.etcd.get_prefix(keys.NODES)
        return _decode_all(types_pb2.Node, kvs, keys.NODES)

    def health(self) -> dict[str, types_pb2.NodeHealth]:
        kvs, _ = self.etcd.get_prefix(keys.HEALTH)
        return _decode_all(types_pb2.NodeHealth, kvs, keys.HEALTH)

    def node_health(self, node: str) -> types_pb2.NodeHealth | None:
        return self._get(types_pb2.NodeHealth, keys.health(node))

    def job(self, name: str) -> types_pb2.JobSpec | None:
        return self._get(types_pb2.JobSpec, keys.job_spec(name))

    def jobs(self) -> dict[str, types_pb2.JobSpec]:
        kvs, _ = self.etcd.get_prefix(keys.JOBS)
        return {
            k[: -len("/spec")]: v
            for k, v in _decode_all(types_pb2.JobSpec, (kv for kv in kvs if kv.key.endswith("/spec")), keys.JOBS).items()
        }

    def job_specs(self) -> dict[str, types_pb2.JobSpec]:
        """Every job spec, without reading plans or their history (a keys-only listing,
        then the spec keys)."""
        listed, _ = self.etcd.get_prefix(keys.JOBS, keys_only=True)
        out: dict[str, types_pb2.JobSpec] = {}
        for kv in listed:
            k = keys.parse(kv.key)
            if k is not None and k.kind is Kind.JOB_SPEC:
                spec = self.job(k.name)
                if spec is not None:
                    out[k.name] = spec
        return out

    def spec_guard_revision(self) -> int:
        kv = self.etcd.get(keys.SPEC_GUARD)
        return kv.mod_revision if kv is not None else 0

    def write_spec(self, job: str, spec: types_pb2.JobSpec | None, *, spec_revision: int,
                   guard_revision: int) -> int:
        """Store (or with None delete, with its override, acks and credentials) a job spec, only if
        neither the spec key nor the spec guard moved since they were read at the given
        mod revisions (0 = absent). The write's revision; 0 when a key moved (nothing
        written)."""
        key = keys.job_spec(job)
        compare = [_unchanged(key, spec_revision), _unchanged(keys.SPEC_GUARD, guard_revision)]
        if spec is not None:
            ops = [Op.put(key, codec.encode(spec))]
        else:
            ops = [Op.delete(key), Op.delete_prefix(keys.job_acks(job)), Op.delete(keys.job_override(job)),
                   Op.delete_prefix(keys.job_credentials(job))]  # its credentials die with it
        ops.append(Op.put(keys.SPEC_GUARD, job.encode()))
        done = self.etcd.txn(compare, ops)
        return done.revision if done.succeeded else 0

    def plan(self, job: str) -> types_pb2.Plan | None:
        return self._plans(job)[0]

    def plan_history(self, job: str) -> list[types_pb2.Plan]:
        return self._plans(job)[1]

    def _plans(self, job: str) -> tuple[types_pb2.Plan | None, list[types_pb2.Plan]]:
        try:
            return planstore.read_job(self.etcd, job)
        except codec.MalformedValue as exc:
            log.warning("skipping malformed etcd value key=%s error=%s", exc.key, exc)
            return None, []

    def acks(self, job: str) -> dict[int, types_pb2.Ack]:
        prefix = keys.job_acks(job)
        kvs, _ = self.etcd.get_prefix(prefix)
        return {int(k): v for k, v in _decode_all(types_pb2.Ack, kvs, prefix).items() if k.isdigit()}

    def gpu_overrides(self) -> dict[tuple[str, int], types_pb2.GpuOverride]:
        kvs, _ = self.etcd.get_prefix(keys.GPU_OVERRIDES)
        return {
            (o.gpu.node, o.gpu.index): o
            for o in _decode_all(types_pb2.GpuOverride, kvs, keys.GPU_OVERRIDES).values()
        }

    def gpu_holds(self) -> dict[tuple[str, int], types_pb2.GpuHold]:
        """The leader's flap damping: GPUs held as failed (damping.py)."""
        kvs, _ = self.etcd.get_prefix(keys.HOLDS)
        out = {}
        for kv in kvs:
            k = keys.parse(kv.key)
            hold = decode_or_skip(types_pb2.GpuHold, kv) if k is not None else None
            if hold is not None:
                out[(k.name, k.number)] = hold
        return out

    def job_override(self, job: str) -> types_pb2.JobOverride | None:
        return self._get(types_pb2.JobOverride, keys.job_override(job))

    def node_power(self, node: str) -> types_pb2.NodePowerPlan | None:
        return self._get(types_pb2.NodePowerPlan, keys.power(node))

    def events(self, limit: int = 100, job: str | None = None) -> list[types_pb2.Event]:
        """The latest ``limit`` events (of ``job`` only, when given), oldest first."""
        kvs, _ = self.etcd.get_prefix(keys.EVENTS)
        if job is None:
            return list(_decode_all(types_pb2.Event, kvs[-limit:], keys.EVENTS).values())
        events = [e for e in _decode_all(types_pb2.Event, kvs, keys.EVENTS).values() if e.job == job]
        return events[-limit:]

    # ---- operator / registration writes (any controller replica) ----

    def update(
        self, key: str, cls: type[M], change: Callable[[M | None], M | None], attempts: int = 8,
        *, requires: str | None = None,
    ) -> Updated[M]:
        """Read-modify-write of one key, atomic: ``change`` gets the stored value (None
        when absent or unreadable) and returns the one to store (None = delete; the very
        object it was given = leave the key as it is). The write compares the key's mod
        revision with the one read, and is retried on a lost race. Returns (old, new,
        revision) of the write that won (:class:`Updated`); :class:`UpdateConflict` after
        ``attempts`` lost races. ``requires``: a key that must exist when the write lands
        (a job's override only while its spec does: a delete of the job removes both, and
        an override written after it would outlive the job): :class:`RequiredKeyGone`
        when it does not."""
        for _ in range(attempts):
            kv = self.etcd.get(key)
            old = decode_or_skip(cls, kv) if kv is not None else None
            new = change(old)
            if new is old:
                return Updated(old, old, kv.mod_revision if kv is not None else 0)
            guard = [_unchanged(key, kv.mod_revision if kv is not None else 0)]
            if requires is not None:
                guard.append(Cmp.create_revision(requires, ">", 0))
            op = Op.put(key, codec.encode(new)) if new is not None else Op.delete(key)
            done = self.etcd.txn(guard, [op])
            if done.succeeded:
                return Updated(old, new, done.revision)
            if requires is not None and self.etcd.get(requires) is None:
                raise RequiredKeyGone(f"{requires} is gone")
        raise UpdateConflict(f"{key} was changed concurrently {attempts} times in a row; retry")

    def put_rack(self, rack: types_pb2.Rack) -> int:
        return self.etcd.put(keys.rack(rack.name), codec.encode(rack))

    def write_rack(self, name: str, rack: types_pb2.Rack | None, *, rack_revision: int,
                   guard_revision: int) -> int:
        """Store (or with None delete) a rack record, only if neither its key nor the spec
        guard moved since they were read at the given mod revisions (0 = absent), and move
        the guard: a job spec checked against the old record concurrently is written only
        after it checks again (REST rack inventory). The write's revision; 0 when a key
        moved (nothing written)."""
        key = keys.rack(name)
        compare = [_unchanged(key, rack_revision), _unchanged(keys.SPEC_GUARD, guard_revision)]
        op = Op.put(key, codec.encode(rack)) if rack is not None else Op.delete(key)
        done = self.etcd.txn(compare, [op, Op.put(keys.SPEC_GUARD, f"racks/{name}".encode())])
        return done.revision if done.succeeded else 0

    def put_job(self, spec: types_pb2.JobSpec) -> int:
        return self.etcd.put(keys.job_spec(spec.name), codec.encode(spec))

    def put_gpu_override(self, override: types_pb2.GpuOverride) -> int:
        key = keys.gpu_override(override.gpu.node, override.gpu.index)
        return self.etcd.put(key, codec.encode(override))

    def delete_gpu_override(self, node: str, index: int) -> bool:
        return self.etcd.delete(keys.gpu_override(node, index))

    def put_job_override(self, override: types_pb2.JobOverride) -> int:
        return self.etcd.put(keys.job_override(override.job), codec.encode(override))

    def delete_job_override(self, job: str) -> bool:
        return self.etcd.delete(keys.job_override(job))


def _unchanged(key: str, mod_revision: int):
    if mod_revision:
        return Cmp.mod_revision(key, "==", mod_revision)
    return Cmp.create_revision(key, "==", 0)


def apply_kv(snap: Snapshot, kv: KeyValue, deleted: bool = False, msg: Message | None = None) -> bool:
    """Fold one key-value (or its deletion) into a snapshot; returns whether the key is
    one the planner cares about. ``msg``: the value decoded already (the informer's)."""
    k = keys.parse(kv.key)
    if k is None:
        if kv.key.startswith(keys.GPU_OVERRIDES):
            log.warning("skipping malformed etcd key key=%s", kv.key)
        return False
    if k.kind is Kind.GPU_OVERRIDE:
        return _fold(snap.gpu_overrides, (k.name, k.number), types_pb2.GpuOverride, kv, deleted, msg)
    if k.kind is Kind.GPU_HOLD:
        return _fold(snap.gpu_holds, (k.name, k.number), types_pb2.GpuHold, kv, deleted, msg)
    table = _TABLES.get(k.kind)
    if table is not None:
        attr, cls = table
        return _fold(getattr(snap, attr), k.name, cls, kv, deleted, msg)
    if k.kind in (Kind.JOB_PLAN, Kind.JOB_ASSIGN):
        pk = planstore.PlanKey("header" if k.kind is Kind.JOB_PLAN else "part", k.name, k.number, k.position)
        return fold_plan_key(snap, pk, kv, deleted)
    return False


_TABLES = {
    Kind.RACK: ("racks", types_pb2.Rack),
    Kind.NODE: ("nodes", types_pb2.Node),
    Kind.HEALTH: ("health", types_pb2.NodeHealth),
    Kind.JOB_OVERRIDE: ("job_overrides", types_pb2.JobOverride),
    Kind.JOB_SPEC: ("jobs", types_pb2.JobSpec),
}


ASSEMBLER = planstore.Assembler()  # one per process: it only remembers caps' GPUs


def fold_plan_key(snap: Snapshot, pk: planstore.PlanKey, kv: KeyValue, deleted: bool) -> bool:
    """A plan header or part: parts are indexed, a header becomes the job's whole plan
    (its parts came before it, tpflex_proto.planstore)."""
    if pk.kind == "part":
        index = snap.plan_parts.get(pk.job)
        if deleted:
            if index is not None:
                index.remove(pk.generation, pk.position)
        else:
            snap.plan_parts.setdefault(pk.job, planstore.PartIndex()).add(pk.generation, pk.position, kv.value)
        return True
    if deleted:
        snap.plan_parts.pop(pk.job, None)
        return snap.plans.pop(pk.job, None) is not None
    try:
        snap.plans[pk.job] = planstore.whole(kv.value, snap.plan_parts.get(pk.job), ASSEMBLER, kv.key)
    except codec.MalformedValue as exc:
        log.warning("skipping malformed etcd value key=%s error=%s", kv.key, exc)
        return False
    return True


def _fold(table: dict, name, cls, kv: KeyValue, deleted: bool, msg: Message | None = None) -> bool:
    if deleted:
        return table.pop(name, None) is not None
    if msg is None:
        msg = decode_or_skip(cls, kv)
    if msg is None:
        return False
    table[name] = msg
    return True
