"""The reconcile loop's work queue (controller-runtime's workqueue + reconcileHandler are
the model): the jobs that must be looked at again, when each is due, and one outcome
table saying what each result of a reconcile does to the job's entry. Pure: the caller
passes the monotonic time; no I/O, no locks (one thread owns it)."""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

from tpflex_proto.backoff import delay

# operator changes: a burst of them (a drain/undrain storm) is planned once, when it stops
OPERATOR_CAUSES = frozenset({"drain", "undrain", "power_pin", "override"})


class Result(enum.StrEnum):
    """What reconciling a job came to (the ``result`` label of tpflex_reconcile_total)."""

    OK = "ok"  # planned; committed, or nothing to commit
    CONFLICT = "conflict"  # the fenced compare-and-swap lost: etcd moved since it was read
    ETCD_ERROR = "etcd_error"  # etcd unreachable or refused the request
    UNPLANNABLE = "unplannable"  # the spec cannot be planned (a plan_failed event says why)
    ERROR = "error"  # a bug: the loop goes on with the other jobs


class Action(enum.Enum):
    FORGET = "forget"  # done until a change marks the job again
    REREAD = "reread"  # re-read this job's keys from etcd, then plan it again at once
    RETRY = "retry"  # plan it again after a jittered backoff (0.05 s doubling to 2 s)
    RETRY_SLOW = "retry_slow"  # plan it again after a long backoff (0.5 s doubling to 30 s)


OUTCOMES: dict[Result, Action] = {
    Result.OK: Action.FORGET,
    Result.UNPLANNABLE: Action.FORGET,  # its next spec, override or cluster change marks it
    Result.CONFLICT: Action.REREAD,
    Result.ETCD_ERROR: Action.RETRY,
    Result.ERROR: Action.RETRY_SLOW,
}
_BACKOFF = {Action.RETRY: (0.05, 2.0), Action.RETRY_SLOW: (0.5, 30.0), Action.REREAD: (0.05, 2.0)}


@dataclass
class DirtyJob:
    cause: str
    detected_at: float  # wall clock when the change was seen
    revision: int = 0  # etcd revision of the latest change that marked it
    not_before: float = 0.0  # monotonic; retry backoff, or the end of an operator burst
    attempts: int = 0
    first_seen: float = 0.0  # monotonic
    urgent: bool = True  # marked by something else than operator overrides


def coalesce_until(d: DirtyJob, now: float, quiet_s: float) -> float:
    """When a job marked only by operator overrides is planned: ``quiet_s`` after the
    latest one, but no later than ``8 x quiet_s`` after the first (pure)."""
    if d.urgent or quiet_s <= 0:
        return d.not_before
    return max(d.not_before, min(now + quiet_s, d.first_seen + 8 * quiet_s))


class WorkQueue:
    def __init__(self, coalesce_s: float = 0.0, rng: random.Random | None = None) -> None:
        self._items: dict[str, DirtyJob] = {}
        self._coalesce_s = coalesce_s
        self._rng = rng or random.Random()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, job: str) -> bool:
        return job in self._items

    def get(self, job: str) -> DirtyJob | None:
        return self._items.get(job)

    def mark(self, job: str, cause: str, at: float, now: float, revision: int = 0) -> DirtyJob:
        """Queue ``job`` (or fold a new cause into its entry); ``at`` is wall clock."""
        operator = cause in OPERATOR_CAUSES
        d = self._items.get(job)
        if d is None:
            d = self._items[job] = DirtyJob(cause, at, revision, first_seen=now, urgent=not operator)
        else:
            d.revision = max(d.revision, revision)
            d.urgent = d.urgent or not operator
            if d.cause == "resync" and cause != "resync":
                d.cause = cause
            if not operator and d.attempts == 0:
                d.not_before = 0.0  # a failure is not held back by an operator burst
        d.not_before = coalesce_until(d, now, self._coalesce_s)
        return d

    def due(self, now: float) -> list[tuple[str, DirtyJob]]:
        """The jobs due now, oldest change first."""
        items = sorted(self._items.items(), key=lambda kv: kv[1].detected_at)
        return [(job, d) for job, d in items if d.not_before <= now]

    def next_due(self) -> float | None:
        return min((d.not_before for d in self._items.values()), default=None)

    def settle(self, job: str, result: Result, now: float) -> Action:
        """Apply the outcome table to ``job``'s entry; returns the action taken."""
        action = OUTCOMES[result]
        d = self._items.get(job)
        if d is None:
            return action
        if action is Action.FORGET:
            del self._items[job]
            return action
        d.attempts += 1
        if action is Action.REREAD and d.attempts <= 1:
            d.not_before = 0.0  # at once; a conflict again backs off like an etcd error
        else:
            first, most = _BACKOFF[action]
            d.not_before = now + delay(d.attempts, first, most, self._rng)
        return action

    def forget(self, job: str) -> None:
        self._items.pop(job, None)

    def rearm(self) -> None:
        """Keep every entry and its cause but drop its retries and backoff (a deposed
        leader: whoever leads next plans them at once, with their real causes)."""
        for d in self._items.values():
            d.attempts, d.not_before = 0, 0.0

    def clear(self) -> None:
        self._items.clear()
