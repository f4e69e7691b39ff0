"""Domain types of the planner: plain, immutable, no I/O.

The planner (``tpflex_controller.planner.plan``), the reconcile loop (which converts etcd
protobufs into these at the edge) and the simulator (``tpflex-sim``) all speak these types.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from itertools import compress, count
from operator import is_not

# A GPU is addressed by (node name, NVML index on that node).
GpuKey = tuple[str, int]


class Policy(enum.StrEnum):
    NTP_PW = "ntp-pw"
    NTP = "ntp"
    DP_DROP = "dp-drop"
    SPARE = "spare"

    @classmethod
    def parse(cls, value: str) -> Policy:
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(p.value for p in cls)
            raise ValueError(f"unknown policy {value!r}; expected one of: {names}") from None


class GpuStatus(enum.Enum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"  # usable, possibly slow (relative speed < 1)
    FAILED = "failed"  # not usable (XID 79, double-bit ECC, lost, node lease lapsed)
    DRAINED = "drained"  # taken out by an operator


class ReplicaState(enum.Enum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"  # runs at reduced TP in at least one stage
    DROPPED = "dropped"  # out of the job until repaired
    ON_SPARE = "on-spare"  # a spare domain stands in for at least one stage


@dataclass(frozen=True, slots=True)
class RackInfo:
    name: str
    domain_size: int
    power_budget_w: float
    tdp_w: float
    min_w: float
    max_w: float
    gpus: tuple[GpuKey, ...]  # rack order, distinct
    # the rack's nodes (every node of ``gpus``, distinct), so that the planner can check
    # a healthy rack per node rather than per GPU; () = not given (checked per GPU)
    nodes: tuple[str, ...] = ()
    # per-GPU max limits below ``max_w`` (the tighter of what the GPU reports and the rack
    # record's; convert.rack_info): a GPU absent here takes ``max_w``. Empty for a rack
    # whose GPUs all report the same limits (folded into ``tdp_w``/``min_w``/``max_w``).
    gpu_max_w: Mapping[GpuKey, float] = field(default_factory=dict, hash=False)


def gpu_max(rack: RackInfo, gpu: GpuKey) -> float:
    """The highest cap ``gpu`` of ``rack`` takes (its own max limit, at most the rack's)."""
    limits = rack.gpu_max_w
    return limits.get(gpu, rack.max_w) if limits else rack.max_w


def stage_max(rack: RackInfo, gpus: Iterable[GpuKey]) -> float:
    """The highest uniform cap every GPU of ``gpus`` takes (the lowest of their max
    limits): TP is synchronous, so a stage runs at its slowest GPU's speed."""
    limits = rack.gpu_max_w
    if not limits:
        return rack.max_w
    top = rack.max_w
    return min((limits.get(g, top) for g in gpus), default=top)


def has_headroom(rack: RackInfo, gpus: Iterable[GpuKey]) -> bool:
    """Whether every GPU of ``gpus`` can be capped above the rack's TDP (default limit)."""
    return stage_max(rack, gpus) > rack.tdp_w + 1e-9


@dataclass(frozen=True)
class ClusterState:
    """What the controller observes. Only non-healthy GPUs are listed, so that a state of
    73,728 GPUs stays cheap to build and to copy."""

    racks: Mapping[str, RackInfo]
    # GPUs that are not HEALTHY; a GPU not listed here is HEALTHY (if its node is live)
    gpu_status: Mapping[GpuKey, GpuStatus] = field(default_factory=dict)
    # relative speed of slow GPUs (1.0 when absent)
    gpu_speed: Mapping[GpuKey, float] = field(default_factory=dict)
    # nodes with a live lease; None = every node is live (used by the simulator)
    live_nodes: frozenset[str] | None = None
    # operator power-cap pins (watts)
    power_pins: Mapping[GpuKey, float] = field(default_factory=dict)
    # Optional indexes that the controller's view keeps up to date as it folds events, so
    # that a plan finds the racks with a touched GPU or a dead node from the few such
    # nodes instead of a look-up per node of every rack (65,000 at 262,144 GPUs). Both or
    # neither: ``node_racks`` maps every node a rack lists (``RackInfo.nodes``) to that
    # rack's name, and no node is listed by two racks; ``down_nodes`` holds exactly the
    # nodes racks list that are not in ``live_nodes`` (empty when that is None). A node
    # no rack lists may appear in either; it only makes a rack look touched, never clean.
    node_racks: Mapping[str, str] | None = None
    down_nodes: AbstractSet[str] | None = None
    # Optional, kept by the view with the two above: every node with a touched GPU (a key
    # of ``gpu_status``, ``gpu_speed`` or ``power_pins``) -> exactly those GPUs, so that
    # a plan of a few replicas looks up only their racks' nodes (stages.Survey, lazy).
    touched_by_node: Mapping[str, AbstractSet[GpuKey]] | None = None

    def status(self, gpu: GpuKey) -> GpuStatus:
        if self.live_nodes is not None and gpu[0] not in self.live_nodes:
            return GpuStatus.FAILED
        return self.gpu_status.get(gpu, GpuStatus.HEALTHY)

    def usable(self, gpu: GpuKey) -> bool:
        return self.status(gpu) in (GpuStatus.HEALTHY, GpuStatus.DEGRADED)


@dataclass(frozen=True, slots=True)
class StageSpec:
    rack: str
    gpus: tuple[GpuKey, ...]  # TP ranks of this stage, in order (len == base_tp)


@dataclass(frozen=True, slots=True, weakref_slot=True)  # weakref: planner.memo keys
class ReplicaSpec:
    stages: tuple[StageSpec, ...]  # one per pipeline stage


@dataclass(frozen=True)
class JobSpec:
    name: str
    base_tp: int
    replicas: tuple[ReplicaSpec, ...]
    # unit counts of the sharded weight families, e.g. {"heads": 32, "ffn": 128, "vocab": 64}
    units: Mapping[str, int]
    min_tp: int = 1
    policy: Policy = Policy.NTP_PW
    spare_racks: tuple[str, ...] = ()
    local_batch: int = 1  # samples per step of a healthy replica


def full_tp(job: JobSpec) -> int:
    """T, the TP degree of a failure-free replica: ``base_tp``, or fewer when a unit family
    has fewer units than ``base_tp`` GPUs (each TP rank holds at least one unit of every
    family), e.g. 64 heads on a 72-GPU NVL72 stage. The stage's other GPUs are in-rack
    spares: a failure they cover leaves the replica at T, not degraded. Speed needs,
    batches and throughputs are relative to T (DESIGN.md: a replica at t_r needs T/t_r)."""
    units = job.units
    return min(job.base_tp, *units.values()) if units else job.base_tp


@dataclass(frozen=True)
class JobOverrides:
    pins: Mapping[int, int] = field(default_factory=dict)  # replica index -> TP degree
    policy: Policy | None = None


# The two assignment types are immutable by convention, not frozen: a frozen dataclass
# sets each field through object.__setattr__, which made building the thousands of them
# of a 262,144-GPU plan cost 3-4x more; they stay hashable by value (unsafe_hash).
@dataclass(slots=True, unsafe_hash=True)
class StageAssignment:
    rack: str
    tp_degree: int
    gpus: tuple[GpuKey, ...]  # GPUs used, in TP-rank order
    spec_stage: int


@dataclass(slots=True, unsafe_hash=True)
class ReplicaAssignment:
    index: int
    state: ReplicaState
    stages: tuple[StageAssignment, ...]  # empty when DROPPED
    tp_degree: int  # min over stages; 0 when DROPPED
    local_batch: int  # 0 when DROPPED
    relative_throughput: float  # samples/s vs a healthy replica (0 when DROPPED)
    reason: str


@dataclass(frozen=True, slots=True, order=True)
class SuspendedPin:
    """An operator's TP pin the planner could not honour now (the replica is planned as if
    unpinned); it applies again as soon as it can hold."""

    replica: int
    tp_degree: int
    reason: str


@dataclass(frozen=True)
class PlanResult:
    job: str
    policy: Policy
    replicas: tuple[ReplicaAssignment, ...]
    # per-GPU caps (watts) for every GPU whose cap differs from its rack's TDP
    power_caps: Mapping[GpuKey, float]
    # planned job throughput vs the failure-free job (samples/s ratio, 0..1)
    expected_throughput_ratio: float
    # human-readable reasons, one per change from the failure-free identity plan
    reasons: tuple[str, ...]
    # operator pins that cannot hold now (a failed or drained GPU, a changed spec)
    suspended_pins: tuple[SuspendedPin, ...] = ()
    # ``power_caps`` by replica (index -> the caps of the GPUs it uses; a replica without
    # any is absent), as the planner built it: a re-plan shares the parts of the replicas
    # it did not plan again, so two plans' caps differ only in the parts that are not the
    # same objects (``changed_cap_parts``). None when unknown (a plan read from etcd).
    cap_parts: Mapping[int, Mapping[GpuKey, float]] | None = field(default=None, compare=False, repr=False)
    # ``reasons`` by replica (index -> its lines; a replica without any is absent), shared
    # between plans as ``cap_parts`` is: ``reasons`` is these in index order, then the
    # plan's own (suspended pins). The plan is stored with each replica's lines in that
    # replica's part (tpflex_proto.planstore), so that a generation writes the lines of
    # the replicas it changes, not every degraded replica's. None when unknown.
    reason_parts: Mapping[int, tuple[str, ...]] | None = field(default=None, compare=False, repr=False)

    def same_decision(self, other: PlanResult | None) -> bool:
        """Whether two results decide the same thing (reasons and wording aside)."""
        return (
            other is not None
            and self.policy == other.policy
            and self.replicas == other.replicas
            and _same_caps(self, other)
            and _pin_keys(self.suspended_pins) == _pin_keys(other.suspended_pins)
        )


# what the memos below (and the planner's sums) let go of, held until ``release_evicted``:
# the reconcile loop calls it when idle. Rotating a memo on a decision's path may drop
# the last reference to a whole plan (the one read from etcd when the controller started,
# held last by the memo once the first decision replaced it): freeing its few hundred
# thousand objects took 11 ms inside the first failure's commit at 262,144 GPUs.
_evicted: list = []
_MAX_EVICTED = 8  # where nothing releases them (a dry-run, a test): at most this many


def evict(entry: object) -> None:
    """Keep ``entry`` (something a memo let go of) until ``release_evicted``."""
    if len(_evicted) >= _MAX_EVICTED:
        _evicted.clear()
    _evicted.append(entry)


def release_evicted() -> int:
    """Between decisions (off their path): drop what the memos let go of since the last
    call, and the ``moved`` memo itself (a decision answers its own questions: it
    remembers what it re-planned and encoded), so that a plan no one else holds is freed
    now rather than inside the next decision; returns how many entries went."""
    global _moved_memo
    n = len(_evicted) + sum(1 for memo in _moved_memo if memo[0] is not None)
    _moved_memo = _NO_MOVED
    _evicted.clear()
    return n


# the last two pairs of sequences compared by ``moved`` and their answers: a commit asks
# the same question of the job's previous and new replicas four times (the encoder twice,
# the degrees and the rank count) and of the previous and new parts once; the planner and
# the encoder tell it what they changed
_NO_MOVED: tuple = ((None, None, ()), (None, None, ()))
_moved_memo: tuple = _NO_MOVED


def moved(old: Sequence, new: Sequence) -> Sequence[int]:
    """The positions where two sequences of equal length hold different objects, or a
    superset of them (never a position past either's end): O(positions) compared in C,
    once per pair, or what ``remember_moved`` was told of this pair."""
    for memo in _moved_memo:
        if memo[0] is old and memo[1] is new:
            return memo[2]
    return remember_moved(old, new, compress(count(), map(is_not, old, new)))


def remember_moved(old: Sequence, new: Sequence, positions: Iterable[int]) -> Sequence[int]:
    """Remember ``positions`` as ``moved(old, new)``: every position where the two hold
    different objects must be among them (the planner's re-planned replicas, the parts
    the encoder rebuilt). Holds the last two pairs only (so it keeps four sequences alive
    at most)."""
    global _moved_memo
    positions = tuple(positions)
    evict(_moved_memo[1])
    _moved_memo = ((old, new, positions), _moved_memo[0])
    return positions


# the last two plans an incremental re-plan assembled from a base plan, and the positions
# it planned again: everywhere else the result holds the base's replica, cap part and
# reason part objects (``planner.assemble``), so that a commit of it compares, encodes and
# describes O(those positions), not every degraded replica of the job. Held weakly: a
# deleted job's last plans must not stay alive here.
def _dead() -> None:
    return None


_changed_memo: tuple = ((_dead, _dead, ()), (_dead, _dead, ()))


def remember_changed(base: PlanResult, result: PlanResult, positions: Iterable[int]) -> None:
    """Remember that ``result`` holds ``base``'s replica, cap part and reason part objects
    at every position but ``positions`` (and its reasons are its reason parts' lines in
    position order, then its own). Holds the last two pairs only."""
    global _changed_memo
    _changed_memo = ((weakref.ref(base), weakref.ref(result), tuple(positions)), _changed_memo[0])


def changed_since(old: PlanResult | None, new: PlanResult) -> tuple[int, ...] | None:
    """The positions ``remember_changed`` was told for this pair (None: not told)."""
    if old is None:
        return None
    for base, result, positions in _changed_memo:
        if base() is old and result() is new:
            return positions
    return None


def assembled(result: PlanResult) -> bool:
    """Whether ``result`` is a plan ``remember_changed`` was told of (its reasons are its
    reason parts' lines in position order, then its own)."""
    return any(memo[1]() is result for memo in _changed_memo)


def changed_cap_parts(old: PlanResult, new: PlanResult) -> list[int] | None:
    """The replicas whose cap parts differ between two plans (by identity, then value);
    None when either plan does not know its parts."""
    a, b = old.cap_parts, new.cap_parts
    if a is None or b is None:
        return None
    hint = changed_since(old, new)
    if hint is not None:
        return [i for i in hint if a.get(i) is not b.get(i) and a.get(i) != b.get(i)]
    if len(a) == len(b) and all(b.get(i) is part for i, part in a.items()):
        return []
    return sorted(i for i in a.keys() | b.keys() if a.get(i) is not b.get(i) and a.get(i) != b.get(i))


def _same_caps(a: PlanResult, b: PlanResult) -> bool:
    if changed_cap_parts(a, b) == []:
        return True
    x, y = a.power_caps, b.power_caps
    return len(x) == len(y) and _as_dict(x) == _as_dict(y)


def _as_dict(m: Mapping) -> dict:
    if type(m) is dict:
        return m
    as_dict = getattr(m, "as_dict", None)  # planner.caps.MergedCaps: one walk of its parts
    return as_dict() if as_dict is not None else dict(m)


def _pin_keys(pins: tuple[SuspendedPin, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(sorted((p.replica, p.tp_degree) for p in pins))


class PlanningError(ValueError):
    """The request cannot be planned (bad spec or impossible pin); the message says why."""
