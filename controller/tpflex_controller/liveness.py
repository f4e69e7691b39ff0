"""Rank liveness, the pure part: who stopped beating, what a soft failure does to a job's
restart epoch, and when repeated soft failures of one GPU become a hard failure (drain).

No I/O and no clock: callers pass ``now`` and the stored :class:`types_pb2.Liveness`
record in and write what comes out (``liveness_service`` does, with a compare-and-swap).

- A **soft failure** is a rank that died (tpflex-run reports the exit) or stopped beating
  while its GPU is healthy and in the plan: the job's restart epoch goes up (the plan
  stream tells the survivors to abort their process groups and re-form them with the
  same plan) and the failure is kept in the record's ``recent`` list.
- The same death seen twice (the launcher's report and the missed beats, or two
  controller replicas) counts once: a failure of a rank whose incarnation is not newer
  than one already in ``recent`` is a duplicate.
- A rank declared failed that beats at the job's current restart epoch was alive after
  the declaration (it took part in a round formed since): the declaration was false (its
  stream broke on a replica's error, a beat gap), so the failure is withdrawn from
  ``recent``. Its process's real death later is then a new failure that raises the epoch
  again; kept, it would be a "duplicate" and the round the process joined would wait for
  it forever (its successor does not join a round its predecessor was in).
- A rank that dies while its GPU is outside the plan because the rank was handing its
  units over after a re-plan (a drain, a repair) raises the epoch too -- peers may be
  blocked on it -- but counts against no GPU. One whose GPU *failed* changes nothing: the
  failure generation that dropped the GPU already told its peers to abort and re-form
  (the trainer hooks' ``abort_reason``), and a later epoch would only make every rank
  re-form again (its death is often seen a beat timeout after the GPU's).
- The ``max_soft_failures``-th soft failure of one GPU within ``window_s`` is a **hard**
  failure: the epoch goes up and the GPU is drained with the reasons (the leader re-plans
  without it).
- A **hang** (a rank's watchdog found a collective stuck) bumps the epoch once per epoch
  (many ranks report the same hang) and counts against no GPU: the stuck rank is the
  victim, not the culprit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from tpflex_proto import controller_pb2, types_pb2

from tpflex_controller.spec_checks import InputError, JobFacts

MAX_REASON = 200  # characters of a reason kept from a launcher
MAX_HUNG_S = 86_400.0


@dataclass(frozen=True)
class LivenessPolicy:
    beat_timeout_s: float = 10.0  # no beat for this long: the rank stopped beating
    window_s: float = 300.0  # soft failures of one GPU counted within this window
    max_soft_failures: int = 3  # this many within the window: drain the GPU
    max_recent: int = 64  # soft failures kept per job (oldest dropped)
    beat_burst: int = 20  # beats a stream may send at once ...
    beats_per_s: float = 5.0  # ... then at most this rate (token bucket); beyond it: refused

    def __post_init__(self) -> None:
        if not (self.beat_timeout_s > 0 and self.window_s > 0 and self.max_soft_failures >= 1
                and self.max_recent >= self.max_soft_failures and self.beat_burst >= 1
                and self.beats_per_s > 0):
            raise ValueError(f"invalid liveness policy {self}")


@dataclass(frozen=True)
class Outcome:
    """What a failure does: ``kind`` is duplicate / gpu_failed / outside_plan / soft / hard / hang;
    ``record`` is the record to store (None: leave it); ``drain`` the drain reason (hard)."""

    kind: str
    record: types_pb2.Liveness | None = None
    drain: str = ""


# ---------------------------------------------------------------- input bounds


def check_beat(beat: controller_pb2.Beat, facts: JobFacts, current_epoch: int) -> None:
    """A beat that cannot be true raises :class:`InputError` (an unknown rank, a generation
    or epoch newer than the job's, a non-finite or absurd hang time)."""
    if beat.rank >= facts.ranks:
        raise InputError("invalid", f"rank {beat.rank} is not in job {beat.job} ({facts.ranks} ranks)")
    if beat.generation > facts.generation:
        raise InputError("future", f"generation {beat.generation} is newer than job {beat.job}'s "
                         f"current plan ({facts.generation})")
    if beat.epoch > current_epoch:
        raise InputError("future", f"epoch {beat.epoch} is newer than job {beat.job}'s restart "
                         f"epoch ({current_epoch})")
    if not (math.isfinite(beat.hung_s) and 0.0 <= beat.hung_s <= MAX_HUNG_S):
        raise InputError("invalid", f"hung_s must be a finite number of seconds in [0, {MAX_HUNG_S:g}], "
                         f"got {beat.hung_s!r}")


def clean_reason(reason: str) -> str:
    """A launcher's exit reason, printable and bounded (it ends up in the event log)."""
    text = "".join(c if c.isprintable() else "?" for c in reason[:MAX_REASON])
    return text or "unknown"


@dataclass
class TokenBucket:
    """``take(now)`` is False once a stream beats faster than its policy allows."""

    burst: int
    rate: float
    tokens: float = -1.0
    at: float = 0.0

    def take(self, now: float) -> bool:
        if self.tokens < 0:
            self.tokens, self.at = float(self.burst), now
        self.tokens = min(float(self.burst), self.tokens + max(0.0, now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


# ---------------------------------------------------------------- missed beats


@dataclass(frozen=True)
class Silent:
    """A rank that stopped beating (or whose stream ended) ``beat_timeout_s`` ago."""

    job: str
    rank: int
    incarnation: int
    reason: str  # heartbeat_lost / stream_closed


@dataclass
class BeatTracker:
    """The ranks beating to this controller replica. A rank is watched from its first beat
    until it is reported silent (once per incarnation) or a newer incarnation beats."""

    timeout_s: float
    _last: dict[tuple[str, int], tuple[int, float, bool]] = field(default_factory=dict)

    def beat(self, job: str, rank: int, incarnation: int, now: float) -> None:
        old = self._last.get((job, rank))
        if old is not None and incarnation < old[0]:
            return  # a late beat of a replaced process
        self._last[(job, rank)] = (incarnation, now, False)

    def closed(self, job: str, rank: int, incarnation: int, now: float) -> None:
        """The rank's stream ended: silent unless it beats again within the timeout."""
        old = self._last.get((job, rank))
        if old is not None and old[0] == incarnation:
            self._last[(job, rank)] = (incarnation, min(old[1], now), True)

    def forget(self, job: str, rank: int) -> None:
        self._last.pop((job, rank), None)

    def watched(self) -> int:
        return len(self._last)

    def expired(self, now: float) -> list[Silent]:
        """The ranks silent for longer than the timeout, each reported once."""
        out = []
        for (job, rank), (inc, at, closed) in sorted(self._last.items()):
            if now - at > self.timeout_s:
                out.append(Silent(job, rank, inc, "stream_closed" if closed else "heartbeat_lost"))
        for s in out:
            del self._last[(s.job, s.rank)]
        return out


# ---------------------------------------------------------------- the record


def _epoch(record: types_pb2.Liveness | None) -> int:
    return record.restart.epoch if record is not None else 0


def _next(record: types_pb2.Liveness | None, job: str, recent: Iterable[types_pb2.SoftFailure],
          rank: int, reason: str, now: float) -> types_pb2.Liveness:
    out = types_pb2.Liveness(job=job)
    out.restart.CopyFrom(types_pb2.Restart(epoch=_epoch(record) + 1, reason=reason, rank=rank, at=now))
    out.recent.extend(recent)
    return out


def apply_failure(record: types_pb2.Liveness | None, job: str, failure: types_pb2.SoftFailure,
                  policy: LivenessPolicy, now: float, *, in_plan: bool, gpu_failed: bool = False) -> Outcome:
    """The record after ``failure`` (a rank of ``job`` died or went silent at ``now``).
    ``in_plan``: the rank's GPU is in the job's current plan (else the plan already does
    without it: a GPU failure or a drain, not a soft failure). ``gpu_failed``: its agent
    reports the GPU failed."""
    if not in_plan and gpu_failed:  # the failure generation already re-formed the peers
        return Outcome("gpu_failed")
    recent = [f for f in (record.recent if record is not None else ()) if now - f.at <= policy.window_s]
    if any(f.rank == failure.rank and f.incarnation >= failure.incarnation for f in recent):
        return Outcome("duplicate")
    failure = types_pb2.SoftFailure(rank=failure.rank, node=failure.node, gpu=failure.gpu,
                                    incarnation=failure.incarnation, reason=failure.reason,
                                    at=failure.at, outside_plan=not in_plan)
    recent = (recent + [failure])[-policy.max_recent:]
    what = f"rank {failure.rank} on {failure.node}:{failure.gpu} {failure.reason}"
    if not in_plan:  # peers may still be blocked on it (a hand-over): re-form, count nothing
        return Outcome("outside_plan", _next(record, job, recent, failure.rank, f"rank exit outside the plan: {what}", now))
    same_gpu = [f for f in recent if (f.node, f.gpu) == (failure.node, failure.gpu) and not f.outside_plan]
    if len(same_gpu) < policy.max_soft_failures or not failure.node:  # no GPU known: nothing to drain
        return Outcome("soft", _next(record, job, recent, failure.rank, f"soft failure: {what}", now))
    reasons = ", ".join(f.reason for f in same_gpu)
    drain = (f"liveness: {len(same_gpu)} soft failures of the rank on {failure.node}:{failure.gpu} "
             f"within {policy.window_s:g}s ({reasons})")
    return Outcome("hard", _next(record, job, recent, failure.rank, f"hard failure: {what}", now), drain)


def apply_revival(record: types_pb2.Liveness | None, rank: int, incarnation: int,
                  applied_epoch: int) -> Outcome:
    """A beat of ``rank``'s process ``incarnation`` that applied restart epoch
    ``applied_epoch``: when that process is in ``recent`` and the epoch is the record's
    current one (raised by its failure or later), the failure is withdrawn (``revived``);
    else nothing changes (``none``)."""
    if record is None or applied_epoch < record.restart.epoch:
        return Outcome("none")
    keep = [f for f in record.recent if (f.rank, f.incarnation) != (rank, incarnation)]
    if len(keep) == len(record.recent):
        return Outcome("none")
    out = types_pb2.Liveness(job=record.job)
    out.restart.CopyFrom(record.restart)
    out.recent.extend(keep)
    return Outcome("revived", out)


def declared(record: types_pb2.Liveness | None, rank: int, incarnation: int) -> bool:
    """Whether ``recent`` holds a failure of this process."""
    return record is not None and any((f.rank, f.incarnation) == (rank, incarnation) for f in record.recent)


def apply_hang(record: types_pb2.Liveness | None, job: str, rank: int, applied_epoch: int,
               hung_s: float, now: float) -> Outcome:
    """A rank's watchdog found a collective stuck for ``hung_s`` under ``applied_epoch``:
    bump the epoch unless someone already did since that epoch."""
    if applied_epoch != _epoch(record):
        return Outcome("duplicate")
    keep = list(record.recent) if record is not None else []
    return Outcome("hang", _next(record, job, keep, rank, f"hang: rank {rank} stuck {hung_s:.1f}s in a collective", now))


def rank_gpus(spec: types_pb2.JobSpec) -> list[tuple[str, int]]:
    """The (node, GPU index) of each rank of ``spec``, in rank order (replicas, stages)."""
    return [(g.node, g.index) for rep in spec.replicas for st in rep.stages for g in st.ranks]


def plan_gpus(plan: types_pb2.Plan | None) -> set[tuple[str, int]]:
    """The GPUs the plan uses (an empty set without a plan)."""
    if plan is None:
        return set()
    out = set()
    for rep in plan.replicas:
        for st in rep.stages:
            out.update((g.node, g.index) for g in st.gpus)
    return out
