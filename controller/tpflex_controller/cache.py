"""The reconcile loop's in-memory view of ``/tpflex/v1/``, folded from watch events.

One thread (the reconciler's) owns a :class:`ClusterView`; nothing here locks. Folding a
key returns the jobs that must be looked at again and why (level-triggered: the cause is
for the event log and metrics, the loop re-reads the whole view anyway). The planner's
``ClusterState`` is kept incrementally (non-healthy GPUs only), so a failure on one node
costs O(that node), not O(cluster).
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from google.protobuf.message import Message
from tpflex_proto import codec, keys, planstore, types_pb2
from tpflex_proto.etcd import KeyValue
from tpflex_proto.informer import Change
from tpflex_proto.keys import Key, Kind

from tpflex_controller import convert
from tpflex_controller.damping import FlapDamper
from tpflex_controller.planner.incremental import Changes
from tpflex_controller.planner.model import (
    ClusterState,
    GpuKey,
    GpuStatus,
    JobSpec,
    PlanningError,
    PlanResult,
    RackInfo,
)
from tpflex_controller.store import (
    ASSEMBLER,
    Snapshot,
    apply_kv,
    decode_or_skip,
    fold_plan_key,
)

log = logging.getLogger(__name__)

# kinds only the informer's ordered stream brings (this process never writes them, a
# conflict's re-read never reads them): no older change of a deleted key can follow, so
# the delete needs no revision kept
_WATCHED_ONLY = frozenset({Kind.NODE, Kind.HEALTH, Kind.RACK, Kind.GPU_OVERRIDE, Kind.JOB_OVERRIDE})

_GPU_STATE = {
    types_pb2.GPU_DEGRADED: GpuStatus.DEGRADED,
    types_pb2.GPU_FAILED: GpuStatus.FAILED,
}

Dirty = list[tuple[str, str]]  # (job, cause)


@dataclass(frozen=True, slots=True)
class NodePower:
    """What the view keeps of a node's power plan (``power/<node>``): its generation and
    its caps, (GPU index, watts) in the plan's order. A decoded ``NodePowerPlan`` is ~1.2 KB
    of upb arena, this about a third of it; one per node that has a plan (10,000 in the
    load bench, created as failures first touch each rack: the controller grew with them)."""

    generation: int
    caps: tuple[tuple[int, float], ...]

    @classmethod
    def of(cls, plan: types_pb2.NodePowerPlan) -> NodePower:
        return cls(plan.generation, tuple((c.gpu.index, c.cap_w) for c in plan.caps))

    def to_proto(self, node: str) -> types_pb2.NodePowerPlan:
        return types_pb2.NodePowerPlan(node=node, generation=self.generation, caps=[
            types_pb2.PowerCap(gpu=types_pb2.GpuRef(node=node, index=i), cap_w=w) for i, w in self.caps])

    def wire(self, node: str) -> bytes:
        """``codec.encode(self.to_proto(node))``, written out (planbytes.power_plan_wire):
        a commit writes the plans of a boosted rack's 18 nodes."""
        from tpflex_controller.planbytes import power_plan_wire

        return power_plan_wire(node, self.generation, self.caps)


@dataclass
class PlanRecord:
    """The current plan of a job as the view knows it."""

    generation: int
    mod_revision: int
    proto: types_pb2.Plan | None
    raw: bytes  # the stored header (tpflex_proto.planstore)
    result: PlanResult | None = None  # converted lazily (or kept from our own commit)
    parts: list[bytes] = field(default_factory=list)  # the stored part of each replica

    def decision(self) -> PlanResult:
        if self.result is None:
            proto = self.proto if self.proto is not None else decode_plan(self.raw, "?")
            self.result = convert.plan_from_proto(proto)
        return self.result


class ClusterView:
    def __init__(self, event_log_size: int = 1000, default_policy: str = "ntp-pw") -> None:
        self.default_policy = default_policy  # for specs that do not choose a policy
        self.snap = Snapshot()
        self.racks: dict[str, RackInfo] = {}
        self.node_rack: dict[str, str] = {}
        self.rack_jobs: dict[str, set[str]] = {}
        self.live_nodes: set[str] = set()
        # the racked nodes without a live lease, and whether some node was ever listed by
        # two racks (then node_rack cannot index racks for the planner: ClusterState's
        # node_racks / down_nodes are left out from then on)
        self.down_nodes: set[str] = set()
        self._node_listed_twice = False
        self.gpu_status: dict[GpuKey, GpuStatus] = {}
        self.gpu_speed: dict[GpuKey, float] = {}
        self.power_pins: dict[GpuKey, float] = {}
        # node -> its GPUs in any of the three above (ClusterState.touched_by_node)
        self.touched_by_node: dict[str, set[GpuKey]] = {}
        self._health_status: dict[GpuKey, GpuStatus] = {}
        self._node_health_keys: dict[str, set[GpuKey]] = {}
        self._drained: set[GpuKey] = set()
        self._job_specs: dict[str, JobSpec | PlanningError] = {}
        self.plans: dict[str, PlanRecord] = {}
        self.power: dict[str, tuple[NodePower, int]] = {}
        self.acks: dict[str, dict[int, int]] = {}
        # per job, how many ranks hold each latest acked generation (acked_generation)
        self._ack_counts: dict[str, dict[int, int]] = {}
        self.event_seqs: deque[int] = deque()
        self.event_log_size = event_log_size
        self.state = ClusterState(
            racks=self.racks,
            gpu_status=self.gpu_status,
            gpu_speed=self.gpu_speed,
            live_nodes=self.live_nodes,  # a live set, read only by the owning thread
            power_pins=self.power_pins,
            node_racks=self.node_rack,  # the planner's indexes (ClusterState), kept below
            down_nodes=self.down_nodes,
            touched_by_node=self.touched_by_node,
        )
        self.damper: FlapDamper | None = None  # hold-down of recovered GPUs (damping.py)
        # newest revision folded per key: after a re-read, a lagging watch replays events
        # older than what was read; folding them would move the view back in time
        self._key_revs: dict[str, int] = {}
        self.damper_clock: Callable[[], float] = time.monotonic
        # per job, the nodes whose planner input changed since its last plan (take_changes)
        self._changed_nodes: dict[str, set[str]] = {}

    @property
    def plan_parts(self) -> dict[str, planstore.PartIndex]:
        return self.snap.plan_parts

    # ---- queries ----

    def job_spec(self, job: str) -> JobSpec:
        """The planner's view of a job's spec (cached); raises PlanningError."""
        spec = self._job_specs.get(job)
        if spec is None:
            proto = self.snap.jobs[job]
            if not proto.policy:
                proto = types_pb2.JobSpec()
                proto.CopyFrom(self.snap.jobs[job])
                proto.policy = self.default_policy
            try:
                spec = convert.job_spec(proto, self.racks)
            except PlanningError as exc:
                spec = exc
            except ValueError as exc:
                spec = PlanningError(str(exc))
            self._job_specs[job] = spec
        if isinstance(spec, PlanningError):
            raise spec
        return spec

    def rack_of(self, node: str) -> RackInfo | None:
        name = self.node_rack.get(node)
        return self.racks.get(name) if name is not None else None

    def node_gpu_indices(self, node: str) -> range:
        rack = self.snap.racks.get(self.node_rack.get(node, ""))
        return range(rack.gpus_per_node) if rack is not None else range(0)

    def healthy_gpus(self, rack: str) -> int:
        info = self.racks.get(rack)
        if info is None:
            return 0
        return sum(1 for g in info.gpus if self.state.usable(g))

    def acked_generation(self, job: str, ranks: int, generation: int) -> int:
        """The highest generation (at most ``generation``, the current plan's) that at least
        ``ranks`` ranks of ``job`` have acked: each rank's ack is its latest generation, so
        that many ranks run that generation or a newer one (the rollout's ``acked`` phase
        counts the same way); 0 when fewer have acked anything, ``generation`` for a plan
        without ranks. O(distinct acked generations), not O(ranks)."""
        if ranks <= 0:
            return generation
        held = 0
        for gen, count in sorted(self._ack_counts.get(job, {}).items(), reverse=True):
            held += count
            if held >= ranks:
                return min(gen, generation)
        return 0

    def take_changes(self, job: str) -> Changes:
        """The nodes whose GPUs (status, speed, power pin) or liveness changed for ``job``
        since the previous call, for incremental re-planning; a changed rack changes the
        job's spec object instead (``job_spec``), which re-plans the whole job."""
        return Changes(nodes=frozenset(self._changed_nodes.pop(job, ())))

    def next_event_seq(self) -> int:
        return (self.event_seqs[-1] + 1) if self.event_seqs else 1

    # ---- our own writes ----

    def record_commit(self, p, commit, power: dict[str, NodePower], rev: int) -> None:
        """Fold a plan generation this process committed at etcd revision ``rev``. The keys
        it wrote are marked as folded at ``rev``, so that the watch's late delivery of an
        earlier commit cannot move the view back (a stale plan revision would make the
        next commit lose its compare-and-swap)."""
        self.plans[p.job] = PlanRecord(commit.generation, rev, None, commit.header, p.result, commit.all_parts)
        self._key_revs[keys.job_plan(p.job)] = rev
        index = self.plan_parts.setdefault(p.job, planstore.PartIndex())
        for gen in commit.clear_generations:
            for pos in [pos for pos, gens in index.gens.items() if gen in gens]:
                index.remove(gen, pos)
        for pos, part in commit.parts.items():
            index.add(commit.generation, pos, part)
        for gen, pos in commit.trim_parts:
            index.remove(gen, pos)
        index.release(commit.generation)  # the view plans from the current plan only
        self.snap.plans.pop(p.job, None)  # decoded lazily by readers that need the proto
        for node, np in power.items():
            at = commit.power_revs.get(node, rev)  # written ahead of the header (commit_plan)
            self.power[node] = (np, at)
            self._key_revs[keys.power(node)] = at
        if commit.trim_event_seq and self.event_seqs and self.event_seqs[0] == commit.trim_event_seq:
            self.event_seqs.popleft()
        if commit.event_seq:
            self.event_seqs.append(commit.event_seq)

    def forget_plan(self, job: str, power: dict[str, NodePower], rev: int,
                    power_revs: dict[str, int] | None = None) -> None:
        """Fold the removal of a deleted job's plan this process made at ``rev`` (its power
        writes at ``power_revs``, node -> revision, where given)."""
        self.plans.pop(job, None)
        self.snap.plans.pop(job, None)
        self.snap.plan_parts.pop(job, None)
        self.acks.pop(job, None)
        self._ack_counts.pop(job, None)
        self._key_revs[keys.job_plan(job)] = rev
        for node, np in power.items():
            at = (power_revs or {}).get(node, rev)
            self.power[node] = (np, at)
            self._key_revs[keys.power(node)] = at

    # ---- folding ----

    def fold_change(self, c: Change) -> Dirty:
        """Fold one change record of the informer (its value decoded there, once). A
        malformed value (logged there) keeps what the view had; an event's key still
        counts (the sequence numbers in use)."""
        if c.malformed and c.parsed.kind is not Kind.EVENT:
            return []
        return self.fold(c.kind, c.key, c.value, c.mod_revision, c.msg, c.parsed)

    def fold(
        self, kind: str, key: str, value: bytes, mod_revision: int, msg: Message | None = None,
        parsed: Key | None = None,
    ) -> Dirty:
        """Fold one key's change into the view; ``msg``: its value decoded already,
        ``parsed``: its key parsed already (``keys.parse``)."""
        k = parsed if parsed is not None else keys.parse(key)
        if k is None:
            if key.startswith(keys.GPU_OVERRIDES):
                log.warning("skipping malformed etcd key key=%s", key)
            return []
        if k.kind is Kind.JOB_ASSIGN:  # written once, never moves back
            part = planstore.PlanKey("part", k.name, k.number, k.position)
            fold_plan_key(self.snap, part, self._kv(key, value, mod_revision), kind == "delete")
            return []
        fold = self._FOLDS.get(k.kind)
        if fold is None:
            return []
        if mod_revision and k.kind is not Kind.EVENT:
            if mod_revision < self._key_revs.get(key, 0):
                return []
            if kind == "delete" and k.kind in _WATCHED_ONLY:
                self._key_revs.pop(key, None)  # a gone node's keys leave no entry behind
            else:
                self._key_revs[key] = mod_revision
        return fold(self, k, key, value, mod_revision, kind == "delete", msg)

    def _kv(self, key: str, value: bytes, mod_revision: int) -> KeyValue:
        return KeyValue(key, value, 0, mod_revision, 0, 0)

    def _jobs_of_nodes(self, nodes, cause: str) -> Dirty:
        jobs: set[str] = set()
        for n in nodes:
            rack = self.node_rack.get(n)
            if rack is not None:
                for job in self.rack_jobs.get(rack, ()):
                    jobs.add(job)
                    self._changed_nodes.setdefault(job, set()).add(n)
        return [(j, cause) for j in sorted(jobs)]

    def _fold_health_key(self, k: Key, key: str, value: bytes, rev: int, deleted: bool, msg=None) -> Dirty:
        return self._fold_health(sys.intern(k.name), value, deleted, msg)

    def _fold_health(self, node: str, value: bytes, deleted: bool, msg=None) -> Dirty:
        new_status: dict[GpuKey, GpuStatus] = {}
        new_speed: dict[GpuKey, float] = {}
        if deleted:
            self.snap.health.pop(node, None)
        else:
            nh = msg if msg is not None else decode_or_skip(types_pb2.NodeHealth, self._kv(keys.health(node), value, 0))
            if nh is None:
                return []
            self.snap.health[node] = nh
            for g in nh.gpus:
                st = _GPU_STATE.get(g.state)
                if st is not None:
                    new_status[(node, g.index)] = st
                if 0 < g.relative_speed < 1:
                    new_speed[(node, g.index)] = g.relative_speed
        old_keys = self._node_health_keys.get(node, set())
        if self.damper is not None:
            self._damp(old_keys | set(new_status), new_status)
        new_keys = set(new_status) | set(new_speed)
        failed = recovered = degraded = False
        for gpu in old_keys | new_keys:
            before, after = self._health_status.get(gpu), new_status.get(gpu)
            speed_before, speed_after = self.gpu_speed.get(gpu), new_speed.get(gpu)
            if before == after and speed_before == speed_after:
                continue
            failed |= after is GpuStatus.FAILED
            recovered |= (before is GpuStatus.FAILED and after is not GpuStatus.FAILED) or (
                before is not None and after is None
            )
            degraded = True
            _set(self._health_status, gpu, after)
            _set(self.gpu_speed, gpu, speed_after)
            self._merge_status(gpu)
        if new_keys:
            self._node_health_keys[node] = new_keys
        else:  # a healthy or deleted node holds no entry (10,000 empty sets otherwise)
            self._node_health_keys.pop(node, None)
        if not (failed or recovered or degraded):
            return []
        cause = "gpu_failed" if failed else "gpu_recovered" if recovered else "gpu_degraded"
        return self._jobs_of_nodes([node], cause)

    def _damp(self, gpus: set[GpuKey], new_status: dict[GpuKey, GpuStatus]) -> None:
        """A recovered GPU still in its hold-down keeps counting as failed."""
        now = self.damper_clock()
        for gpu in gpus:
            failed = new_status.get(gpu) is GpuStatus.FAILED
            if self.damper.observe(gpu, failed, now) and not failed:
                new_status[gpu] = GpuStatus.FAILED

    def attach_damper(self, damper: FlapDamper, clock: Callable[[], float]) -> Dirty:
        """Use ``damper`` from here on; re-fold the nodes it holds GPUs of."""
        self.damper, self.damper_clock = damper, clock
        for gpu in damper.tracked():  # a fresh view has not seen these GPUs fail
            self._node_health_keys.setdefault(gpu[0], set()).add(gpu)
        return self.refold_health({gpu[0] for gpu in damper.tracked()})

    def release_held(self) -> Dirty:
        """Let GPUs whose hold-down has ended be planned again."""
        if self.damper is None:
            return []
        due = self.damper.release_due(self.damper_clock())
        return self.refold_health({gpu[0] for gpu in due})

    def refold_health(self, nodes) -> Dirty:
        dirty: Dirty = []
        for node in sorted(nodes):
            nh = self.snap.health.get(node)
            value = nh.SerializeToString() if nh is not None else b""
            dirty += self._fold_health(node, value, nh is None)
        return dirty

    def _merge_status(self, gpu: GpuKey) -> None:
        """A GPU's status from its health and drain; also keeps ``touched_by_node`` (every
        change of the GPU's status, speed or pin ends here)."""
        health = self._health_status.get(gpu)
        if health is GpuStatus.FAILED:
            self.gpu_status[gpu] = health
        elif gpu in self._drained:
            self.gpu_status[gpu] = GpuStatus.DRAINED
        else:
            _set(self.gpu_status, gpu, health)
        node = gpu[0]
        held = self.touched_by_node.get(node)
        if gpu in self.gpu_status or gpu in self.gpu_speed or gpu in self.power_pins:
            if held is None:
                self.touched_by_node[node] = {gpu}
            else:
                held.add(gpu)
        elif held is not None:
            held.discard(gpu)
            if not held:
                del self.touched_by_node[node]

    def _fold_node(self, k: Key, key: str, value: bytes, rev: int, deleted: bool, msg=None) -> Dirty:
        node = sys.intern(k.name)  # the racks' GPU keys hold the same objects (convert)
        if deleted:
            self.snap.nodes.pop(node, None)
            if node not in self.live_nodes:
                return []
            self.live_nodes.discard(node)
            if node in self.node_rack:
                self.down_nodes.add(node)
            return self._jobs_of_nodes([node], "node_lost")
        if not apply_kv(self.snap, self._kv(keys.node(node), value, rev), msg=msg):
            return []
        limits = self._refresh_limits(node)
        if node in self.live_nodes:
            return limits
        self.live_nodes.add(node)
        self.down_nodes.discard(node)
        return self._jobs_of_nodes([node], "node_joined")

    def _refresh_limits(self, node: str) -> Dirty:
        """A node's registration carries its GPUs' power limits (convert.device_limits):
        when they change its rack's limits, the rack info is rebuilt and the rack's jobs
        planned again (their replicas on this node's rack)."""
        name = self.node_rack.get(node)
        old = self.racks.get(name) if name is not None else None
        rack = self.snap.racks.get(name) if name is not None else None
        if old is None or rack is None:
            return []
        tdp, lo, hi, per_gpu = convert.device_limits(rack, list(old.nodes), self.snap.nodes)
        if (tdp, lo, hi) == (old.tdp_w, old.min_w, old.max_w) and per_gpu == old.gpu_max_w:
            return []
        self.racks[name] = replace(old, tdp_w=tdp, min_w=lo, max_w=hi, gpu_max_w=per_gpu)
        return self._jobs_of_nodes([node], "rack_changed")

    def _fold_rack(self, k: Key, key: str, value: bytes, rev: int, deleted: bool, msg=None) -> Dirty:
        name = k.name
        if not apply_kv(self.snap, self._kv(key, value, rev), deleted, msg) and not deleted:
            return []  # malformed: keep what we had
        old = self.racks.pop(name, None)
        if old is not None:
            for n in old.nodes:
                if self.node_rack.get(n) == name:
                    del self.node_rack[n]
                    self.down_nodes.discard(n)
        rack = self.snap.racks.get(name)
        if rack is not None:
            info = self.racks[name] = convert.rack_info(rack, self.snap.nodes)
            for n in info.nodes:
                if self.node_rack.get(n, name) != name and not self._node_listed_twice:
                    self._node_listed_twice = True
                    self.state = replace(self.state, node_racks=None, down_nodes=None, touched_by_node=None)
                self.node_rack[n] = name
                if n not in self.live_nodes:
                    self.down_nodes.add(n)
        jobs = self.rack_jobs.get(name, set())
        for j in jobs:
            self._job_specs.pop(j, None)
        return [(j, "rack_changed") for j in sorted(jobs)]

    def _fold_hold(self, k: Key, key: str, value: bytes, rev: int, deleted: bool, msg=None) -> Dirty:
        apply_kv(self.snap, self._kv(key, value, rev), deleted, msg)  # adopted when elected (holds.py)
        return []

    def _fold_power(self, k: Key, key: str, value: bytes, rev: int, deleted: bool, msg=None) -> Dirty:
        node = k.name
        if deleted:
            self.power.pop(node, None)
            return []
        if msg is None:
            msg = decode_or_skip(types_pb2.NodePowerPlan, self._kv(key, value, rev))
        if msg is not None:
            self.power[node] = (NodePower.of(msg), rev)
        return []

    def _fold_event(self, k: Key, key: str, value: bytes, rev: int, deleted: bool, msg=None) -> Dirty:
        seq = k.number
        if deleted:
            if seq in self.event_seqs:
                self.event_seqs.remove(seq)
        elif not self.event_seqs or seq > self.event_seqs[-1]:
            self.event_seqs.append(seq)
        return []

    def _fold_job_override(self, k: Key, key: str, value: bytes, rev: int, deleted: bool, msg=None) -> Dirty:
        if apply_kv(self.snap, self._kv(key, value, rev), deleted, msg):
            return [(k.name, "override")]
        return []

    def _fold_gpu_override(self, k: Key, key: str, value: bytes, rev: int, deleted: bool, msg=None) -> Dirty:
        gpu_key = (sys.intern(k.name), k.number)
        before = self.snap.gpu_overrides.get(gpu_key)
        apply_kv(self.snap, self._kv(key, value, rev), deleted, msg)
        after = self.snap.gpu_overrides.get(gpu_key)
        was_drained, is_drained = bool(before and before.drained), bool(after and after.drained)
        pin_before = before.power_cap_w if before else 0.0
        pin_after = after.power_cap_w if after else 0.0
        if is_drained:
            self._drained.add(gpu_key)
        else:
            self._drained.discard(gpu_key)
        _set(self.power_pins, gpu_key, pin_after if pin_after > 0 else None)
        self._merge_status(gpu_key)
        if was_drained != is_drained:
            return self._jobs_of_nodes([gpu_key[0]], "drain" if is_drained else "undrain")
        if pin_before != pin_after:
            return self._jobs_of_nodes([gpu_key[0]], "power_pin")
        return []

    def _fold_spec(self, k: Key, key: str, value: bytes, rev: int, deleted: bool, msg=None) -> Dirty:
        job = k.name
        if not apply_kv(self.snap, self._kv(key, value, rev), deleted, msg) and not deleted:
            return []  # malformed: keep what we had
        for jobs in self.rack_jobs.values():
            jobs.discard(job)
        self._job_specs.pop(job, None)
        spec = self.snap.jobs.get(job)
        if spec is None:
            return [(job, "job_spec")]
        names = {st.rack for rep in spec.replicas for st in rep.stages} | set(spec.spare_racks)
        for name in names:
            self.rack_jobs.setdefault(name, set()).add(job)
        return [(job, "job_spec")]

    def _fold_plan(self, k: Key, key: str, value: bytes, rev: int, deleted: bool, msg=None) -> Dirty:
        job = k.name
        if deleted:
            self.plans.pop(job, None)
            self.snap.plans.pop(job, None)
            self.snap.plan_parts.pop(job, None)
            return [(job, "resync")]
        known = self.plans.get(job)
        if known is not None and known.raw == value:
            known.mod_revision = rev  # our own commit, seen again through the watch
            return []
        try:
            header = decode_plan(value, key)
            parts = []
            if header.split:
                index = self.plan_parts.get(job) or planstore.PartIndex()
                parts = index.select(header.generation, header.stored_replicas, key)
                index.release(header.generation)
            proto = planstore.decode_plan(ASSEMBLER.whole(value, parts), key) if header.split else header
        except (codec.MalformedValue, ValueError) as exc:
            log.warning("skipping malformed etcd value key=%s error=%s", key, exc)
            return []
        self.plans[job] = PlanRecord(proto.generation, rev, proto, value, parts=parts)
        self.snap.plans[job] = proto
        return [(job, "resync")]

    def _fold_ack(self, k: Key, key: str, value: bytes, rev: int, deleted: bool, msg=None) -> Dirty:
        acks = self.acks.setdefault(k.name, {})
        counts = self._ack_counts.setdefault(k.name, {})
        if deleted:
            _uncount(counts, acks.pop(k.number, None))
            return []
        ack = msg if msg is not None else decode_or_skip(types_pb2.Ack, self._kv(key, value, 0))
        if ack is not None:
            _uncount(counts, acks.get(k.number))
            acks[k.number] = ack.generation
            counts[ack.generation] = counts.get(ack.generation, 0) + 1
        return []

    _FOLDS = {
        Kind.HEALTH: _fold_health_key,
        Kind.NODE: _fold_node,
        Kind.RACK: _fold_rack,
        Kind.POWER: _fold_power,
        Kind.GPU_HOLD: _fold_hold,
        Kind.EVENT: _fold_event,
        Kind.JOB_OVERRIDE: _fold_job_override,
        Kind.GPU_OVERRIDE: _fold_gpu_override,
        Kind.JOB_SPEC: _fold_spec,
        Kind.JOB_PLAN: _fold_plan,
        Kind.JOB_ACK: _fold_ack,
    }


decode_plan = planstore.decode_plan


def _uncount(counts: dict[int, int], generation: int | None) -> None:
    """One rank fewer at ``generation`` (None: the rank had no ack)."""
    if generation is None:
        return
    left = counts.get(generation, 0) - 1
    if left > 0:
        counts[generation] = left
    else:
        counts.pop(generation, None)


def _set(table: dict, key, value) -> None:
    if value is None:
        table.pop(key, None)
    else:
        table[key] = value
