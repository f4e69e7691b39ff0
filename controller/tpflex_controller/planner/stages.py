"""Per-replica drafts: which GPUs of each pipeline stage are usable, and the degree each
stage runs at under each policy (pure).

A draft is the planner's working copy of one replica; ``planner.plan`` turns drafts into
``ReplicaAssignment``s once power caps are known.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from itertools import filterfalse
from operator import itemgetter

from tpflex_controller.planner.model import (
    ClusterState,
    GpuKey,
    GpuStatus,
    JobSpec,
    RackInfo,
    ReplicaSpec,
    ReplicaState,
    full_tp,
)

_node_of = itemgetter(0)
_NOT_USABLE = (GpuStatus.FAILED, GpuStatus.DRAINED)
_STATUS_NAMES = {s: s.value for s in GpuStatus}  # an enum's .value is a slow descriptor


class Survey:
    """What one plan call looks up per stage, computed once from the cluster: the GPUs
    that need a per-GPU look (non-healthy, slow or power-pinned), the unusable ones and
    their nodes, and which racks are clean (memoised per rack name for this call only)."""

    __slots__ = ("_racks", "by_node", "by_rack", "cluster", "down_racks", "live", "touched", "touched_nodes",
                 "unusable")

    def __init__(self, cluster: ClusterState, lazy: bool = False) -> None:
        """``lazy`` (with the view's indexes, ``ClusterState.touched_by_node``): look the
        touched GPUs up per node, rack and GPU as the plan asks, O(what it asks), instead
        of indexing all of them first, O(touched GPUs of the cluster): for a plan of a few
        replicas in a cluster with thousands of failed GPUs (an incremental re-plan)."""
        self.cluster = cluster
        self.live = cluster.live_nodes
        index, down, by_node = cluster.node_racks, cluster.down_nodes, cluster.touched_by_node
        if lazy and index is not None and down is not None and by_node is not None:
            self.by_node = by_node  # type: ignore[assignment]
            self.touched_nodes = _NodeKeys(by_node)  # type: ignore[assignment]
            self.touched = _Touched(by_node)  # type: ignore[assignment]
            self.unusable = _Unusable(cluster.gpu_status)  # type: ignore[assignment]
            self.by_rack = _RackTouched(cluster.racks, by_node)  # type: ignore[assignment]
            self.down_racks = {index.get(n) for n in down}
            self._racks = {}
            return
        self.touched = touched_gpus(cluster)
        self.by_node: dict[str, list[GpuKey]] = {}  # the touched GPUs of each node
        by_node = self.by_node
        for g in self.touched:
            held = by_node.get(g[0])
            if held is None:
                by_node[g[0]] = [g]
            else:
                held.append(g)
        self.touched_nodes = set(self.by_node)
        self.unusable = unusable_gpus(cluster)
        self._racks: dict[str, bool] = {}
        # with the view's indexes (ClusterState.node_racks): the touched GPUs of each rack,
        # and the racks with a dead node; a rack in neither is clean (None: no indexes)
        self.by_rack: dict[str | None, list[GpuKey]] | None = None
        self.down_racks: set[str | None] | None = None
        index, down = cluster.node_racks, cluster.down_nodes
        if index is not None and down is not None:
            by_rack: dict[str | None, list[GpuKey]] = {}
            for node, held in by_node.items():
                rack = index.get(node)
                listed = by_rack.get(rack)
                if listed is None:
                    by_rack[rack] = list(held)
                else:
                    listed.extend(held)
            self.by_rack = by_rack
            self.down_racks = {index.get(n) for n in down}

    def lost(self, gpus: tuple[GpuKey, ...], rack: RackInfo) -> set[GpuKey] | None:
        """The unusable GPUs of a stage (failed, drained, or on a dead node); None when
        the stage is clean: no GPU of it touched, all its nodes live. A stage on its
        rack's first GPUs is found clean per node of the rack (once per rack), and, when
        its nodes are live, its lost GPUs among the touched GPUs of the rack's nodes; the
        other checks are set operations (in C: no Python work per GPU)."""
        if rack.nodes and _rack_prefix(gpus, rack):
            if self._rack_clean(rack):
                return None
            if self.live is None or self.live.issuperset(rack.nodes):
                return self._lost_on_nodes(gpus, rack)
        out = self.unusable.intersection(gpus)
        if not self.all_live(gpus, rack):
            live = self.live
            out.update(g for g in gpus if g[0] not in live)
        if not out and self.touched.isdisjoint(gpus):
            return None
        return out

    def clean_replica(self, spec: ReplicaSpec) -> bool:
        """Whether every stage of a replica is clean by the per-rack check of ``lost``
        (the common case, in one call: a replica found clean needs no draft)."""
        racks, memo = self.cluster.racks, self._racks
        for stage in spec.stages:
            rack = racks[stage.rack]
            gpus = stage.gpus
            if not rack.nodes or not (gpus is rack.gpus or gpus == rack.gpus[: len(gpus)]):
                return False
            clean = memo.get(rack.name)
            if clean is None:
                clean = self._rack_clean(rack)
            if not clean:
                return False
        return True

    def _lost_on_nodes(self, gpus: tuple[GpuKey, ...], rack: RackInfo) -> set[GpuKey] | None:
        """``lost`` of a stage on its rack's first GPUs, all its nodes live: only the
        touched GPUs of the rack's nodes are looked at (a few), each found in the stage
        by its position (``rack_position``), not by a scan of the stage."""
        by_node, unusable = self.by_node, self.unusable
        out: set[GpuKey] = set()
        touched = False
        n = len(gpus)
        for node in rack.nodes:
            for g in by_node.get(node, ()):
                if rack_position(rack, g) < n:
                    touched = True
                    if g in unusable:
                        out.add(g)
        return out if touched else None

    def _rack_clean(self, rack: RackInfo) -> bool:
        clean = self._racks.get(rack.name)
        if clean is None and self.by_rack is not None and self.cluster.racks.get(rack.name) is rack:
            clean = rack.name not in self.by_rack and rack.name not in self.down_racks
            self._racks[rack.name] = clean
        if clean is None:
            live = self.live
            clean = self.touched_nodes.isdisjoint(rack.nodes) and (
                live is None or live.issuperset(rack.nodes)
            )
            self._racks[rack.name] = clean
        return clean

    def all_live(self, gpus: tuple[GpuKey, ...], rack: RackInfo) -> bool:
        live = self.live
        if live is None:
            return True
        if rack.nodes and _rack_prefix(gpus, rack) and live.issuperset(rack.nodes):
            return True
        return live.issuperset(map(_node_of, gpus))


class _NodeKeys:
    """The nodes with a touched GPU, from the view's index (``Survey.touched_nodes``)."""

    __slots__ = ("_by_node",)

    def __init__(self, by_node) -> None:
        self._by_node = by_node

    def isdisjoint(self, nodes) -> bool:
        by_node = self._by_node
        return not any(n in by_node for n in nodes)

    def intersection(self, nodes) -> set[str]:
        by_node = self._by_node
        return {n for n in nodes if n in by_node}


class _Touched:
    """The touched GPUs, from the view's per-node index (``Survey.touched``)."""

    __slots__ = ("_by_node",)

    def __init__(self, by_node) -> None:
        self._by_node = by_node

    def isdisjoint(self, gpus) -> bool:
        get = self._by_node.get
        for g in gpus:
            held = get(g[0])
            if held is not None and g in held:
                return False
        return True


class _Unusable:
    """The failed or drained GPUs, looked up in ``gpu_status`` (``Survey.unusable``)."""

    __slots__ = ("_status",)

    def __init__(self, status) -> None:
        self._status = status

    def __contains__(self, gpu: object) -> bool:
        return self._status.get(gpu) in _NOT_USABLE

    def intersection(self, gpus) -> set[GpuKey]:
        get = self._status.get
        return {g for g in gpus if get(g) in _NOT_USABLE}


class _RackTouched:
    """The touched GPUs of a rack's nodes by the rack's key (``Survey.by_rack``), from the
    nodes the rack lists: a rack's listed nodes map to it in the view's ``node_racks``."""

    __slots__ = ("_by_node", "_memo", "_racks")

    def __init__(self, racks, by_node) -> None:
        self._racks, self._by_node, self._memo = racks, by_node, {}

    def get(self, name, default=None):
        memo = self._memo
        if name in memo:
            held = memo[name]
        else:
            rack = self._racks.get(name)
            by_node = self._by_node
            held = [g for n in rack.nodes if n in by_node for g in by_node[n]] if rack is not None else []
            held = memo[name] = held or None
        return default if held is None else held

    def __contains__(self, name: object) -> bool:
        return self.get(name) is not None


def rack_position(rack: RackInfo, gpu: GpuKey) -> int:
    """The position of ``gpu`` in ``rack.gpus`` (a large number when absent), found from
    its node's position when the rack lists its nodes in GPU order with the same GPU
    count each (checked on the GPU found), else by a scan."""
    nodes, gpus = rack.nodes, rack.gpus
    if nodes and len(gpus) % len(nodes) == 0:
        per = len(gpus) // len(nodes)
        node, index = gpu
        try:
            at = nodes.index(sys.intern(node)) * per + index
        except ValueError:
            return 1 << 62
        if 0 <= index < per and gpus[at] == gpu:
            return at
    try:
        return gpus.index(gpu)
    except ValueError:
        return 1 << 62


def _rack_prefix(gpus: tuple[GpuKey, ...], rack: RackInfo) -> bool:
    return gpus is rack.gpus or gpus == rack.gpus[: len(gpus)]


@dataclass(slots=True)
class StageDraft:
    spec_index: int
    rack: RackInfo
    spec_gpus: tuple[GpuKey, ...]
    usable: tuple[GpuKey, ...]  # usable GPUs of the stage, spec (= TP-rank) order
    lost: tuple[tuple[GpuKey, GpuStatus], ...]  # the others, with their status
    degree: int = 0
    cap_w: float | None = None  # uniform boost cap of the used GPUs; None = TDP
    needed_speed: float = 1.0  # speed the stage needs to keep pace (ntp-pw)
    spare_for: str | None = None  # the spec rack this spare stage stands in for
    no_headroom: bool = False  # its used GPUs' max limit leaves nothing above TDP (power.py)

    @property
    def used(self) -> tuple[GpuKey, ...]:
        return self.usable[: self.degree]


@dataclass(slots=True)
class ReplicaDraft:
    index: int
    stages: list[StageDraft]
    pin: int | None
    state: ReplicaState = ReplicaState.HEALTHY
    why: str = ""  # why a replica is dropped
    notes: list[str] = field(default_factory=list)
    # ntp-pw run as plain ntp, and why (e.g. "NTP (no power headroom: ...)"); "" = not
    fallback: str = ""

    @property
    def lost_any(self) -> bool:
        for s in self.stages:
            if s.lost:
                return True
        return False


def unusable_gpus(cluster: ClusterState) -> set[GpuKey]:
    """Listed GPUs that are failed or drained (dead nodes are checked separately)."""
    return {g for g, st in cluster.gpu_status.items() if st in _NOT_USABLE}


def touched_gpus(cluster: ClusterState) -> set[GpuKey]:
    """GPUs that need a per-GPU look: non-healthy, slow or power-pinned."""
    touched = set(cluster.gpu_status)
    touched.update(cluster.gpu_speed)
    touched.update(cluster.power_pins)
    return touched


def replica_draft(
    survey: Survey, index: int, spec: ReplicaSpec, pin: int | None, full_degree: int,
    *, none_if_clean: bool = False,
) -> ReplicaDraft | None:
    """The draft of one replica with every stage at its full usable degree; None when
    ``none_if_clean`` and every stage is clean (it gets the identity assignment).

    A clean stage (see ``Survey.lost``) needs no per-GPU work; in any other the unusable
    GPUs are found by set operations, and only they are looked at one by one."""
    cluster = survey.cluster
    stages: list[StageDraft] = []
    clean = True
    for s_idx, stage in enumerate(spec.stages):
        rack = cluster.racks[stage.rack]
        gpus = stage.gpus
        out = survey.lost(gpus, rack)
        clean = clean and out is None
        if out:
            usable, order = _split(gpus, out, rack if rack.nodes and _rack_prefix(gpus, rack) else None)
            lost = tuple((g, cluster.status(g)) for g in order)
        else:
            usable, lost = gpus, ()
        stages.append(StageDraft(s_idx, rack, gpus, usable, lost, min(len(usable), full_degree)))
    if clean and none_if_clean:
        return None
    return ReplicaDraft(index, stages, pin)


def _split(
    gpus: tuple[GpuKey, ...], out: set[GpuKey], rack: RackInfo | None
) -> tuple[tuple[GpuKey, ...], list[GpuKey]]:
    """The GPUs of ``gpus`` not in ``out`` and those in it, both in ``gpus`` order. When
    ``gpus`` are the first GPUs of ``rack`` (distinct), a few lost GPUs of a long stage
    are found by their positions and the rest copied as slices (in C)."""
    if rack is not None and 4 * len(out) < len(gpus):
        at = sorted(rack_position(rack, g) for g in out)
        usable: tuple[GpuKey, ...] = ()
        start = 0
        for i in at:
            usable += gpus[start:i]
            start = i + 1
        return usable + gpus[start:], [gpus[i] for i in at]
    return tuple(filterfalse(out.__contains__, gpus)), list(filter(out.__contains__, gpus))


def cap_degrees(draft: ReplicaDraft) -> None:
    """Apply the operator's pin (validated by the caller) to every stage."""
    if draft.pin is not None:
        for s in draft.stages:
            s.degree = min(s.degree, draft.pin)


def drop_if_too_small(draft: ReplicaDraft, min_tp: int) -> bool:
    """Drop a replica with a stage that has no usable GPU or runs below ``min_tp``."""
    for s in draft.stages:
        if s.degree == 0:
            return _drop(draft, f"rack {s.rack.name} has no usable GPU")
        if s.degree < min_tp:
            return _drop(draft, f"TP {s.degree} on rack {s.rack.name} is below min_tp {min_tp}")
    return False


def _drop(draft: ReplicaDraft, why: str) -> bool:
    draft.state = ReplicaState.DROPPED
    draft.why = why
    return True


def decide_ntp_pw(draft: ReplicaDraft, job: JobSpec) -> None:
    """ntp-pw: each stage runs at its own usable degree; only reduced stages are boosted
    (the power step sets their caps)."""
    cap_degrees(draft)
    if drop_if_too_small(draft, job.min_tp):
        return
    full = full_tp(job)
    if any(s.degree < full for s in draft.stages):
        draft.state = ReplicaState.DEGRADED


def decide_ntp(draft: ReplicaDraft, job: JobSpec) -> None:
    """ntp: every stage of a degraded replica runs at the replica's smallest degree t_r
    (plain NTP with PP: the idle GPUs of healthier stages could be lent out)."""
    cap_degrees(draft)
    if drop_if_too_small(draft, job.min_tp):
        return
    t_r = min(s.degree for s in draft.stages)
    for s in draft.stages:
        s.degree = t_r
    if t_r < full_tp(job):
        draft.state = ReplicaState.DEGRADED


def decide_dp_drop(draft: ReplicaDraft, job: JobSpec) -> None:
    """dp-drop: a replica with any unusable GPU leaves the job until repaired. A pinned
    replica without failures runs at its pin like under ntp (no boost)."""
    if draft.lost_any:
        lost = next(s for s in draft.stages if s.lost)
        _drop(draft, f"rack {lost.rack.name} lost {len(lost.lost)} GPU(s) (dp-drop)")
        return
    decide_ntp(draft, job)


def decide_spare(
    draft: ReplicaDraft, job: JobSpec, cluster: ClusterState, pool: list[RackInfo]
) -> None:
    """spare: every stage with an unusable GPU moves, whole, to the next fully healthy spare
    rack of ``job.spare_racks`` (in that order, not used by another replica) and runs at
    full TP there. With too few spares left the replica is DROPPED and takes none."""
    degraded = [i for i, s in enumerate(draft.stages) if s.lost]
    if not degraded:
        decide_ntp(draft, job)
        return
    if len(degraded) > len(pool):
        _drop(draft, f"{len(degraded)} stage(s) degraded and {len(pool)} spare rack(s) left")
        return
    for i in degraded:
        old, rack = draft.stages[i], pool.pop(0)
        gpus = rack.gpus[: job.base_tp]
        degree = full_tp(job)
        draft.stages[i] = StageDraft(
            old.spec_index, rack, gpus, gpus, (), degree, spare_for=old.rack.name
        )
        draft.notes.append(_spare_note(old, rack.name, degree))
    decide_ntp(draft, job)
    if draft.state is not ReplicaState.DROPPED:
        draft.state = ReplicaState.ON_SPARE


def _spare_note(old: StageDraft, spare: str, tp: int) -> str:
    return (
        f"rack {old.rack.name} has {len(old.usable)}/{len(old.spec_gpus)} usable GPUs "
        f"({describe_lost(old.lost)}) -> stage {old.spec_index} moved to spare rack {spare} "
        f"at TP {tp}"
    )


def spare_pool(cluster: ClusterState, job: JobSpec) -> list[RackInfo]:
    """Spare racks usable now: in ``job.spare_racks`` order, not a stage of any replica,
    with their first ``base_tp`` GPUs all healthy, live and at full speed."""
    in_use = {st.rack for rep in job.replicas for st in rep.stages}
    pool = []
    for name in job.spare_racks:
        rack = cluster.racks[name]
        gpus = rack.gpus[: job.base_tp]
        if name in in_use or len(gpus) < job.base_tp:
            continue
        if all(
            cluster.status(g) is GpuStatus.HEALTHY and cluster.gpu_speed.get(g, 1.0) >= 1.0
            for g in gpus
        ):
            pool.append(rack)
    return pool


def describe_lost(lost: tuple[tuple[GpuKey, GpuStatus], ...]) -> str:
    return ", ".join(f"{g[0]}:{g[1]} {_STATUS_NAMES[st]}" for g, st in lost) or "none lost"
