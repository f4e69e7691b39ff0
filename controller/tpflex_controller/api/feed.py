"""Typed change records of ``/tpflex/v1/`` and the subscription interface that feeds live
views (the console's stream) from whatever folds etcd's watch into memory.

Today :class:`tpflex_controller.api.cache.ApiStateCache` implements :class:`ChangeFeed`;
an etcd informer shared by the process can implement the same two methods later and the
subscribers stay as they are. Contract: a handler is called on the feeder's thread, after
the change is visible to reads, with the batch of changes of one watch response (in
revision order), or with one ``resync`` change after a full re-read (state may have
changed in any way: re-read everything). A handler must be quick and must not raise
(an exception is logged and dropped).
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tpflex_proto import keys

log = logging.getLogger(__name__)


class Kind(enum.StrEnum):
    RACK = "rack"
    NODE = "node"  # lease-bound registration
    HEALTH = "health"
    GPU_OVERRIDE = "gpu_override"  # name = the node
    JOB = "job"  # spec
    PLAN = "plan"
    PLAN_HISTORY = "plan_history"
    ACK = "ack"  # name = the job
    JOB_OVERRIDE = "job_override"
    POWER = "power"
    EVENT = "event"  # name = the sequence number
    LEADER = "leader"
    OTHER = "other"
    RESYNC = "resync"


@dataclass(frozen=True, slots=True)
class Change:
    kind: Kind
    name: str  # rack, node, job or event seq; "" for leader, resync and unknown keys
    revision: int
    deleted: bool = False


# the feed's kind of each parsed key kind (keys.parse); a key not listed is OTHER
_KINDS = {
    keys.Kind.RACK: Kind.RACK, keys.Kind.NODE: Kind.NODE, keys.Kind.HEALTH: Kind.HEALTH,
    keys.Kind.GPU_OVERRIDE: Kind.GPU_OVERRIDE, keys.Kind.JOB_SPEC: Kind.JOB,
    keys.Kind.JOB_PLAN: Kind.PLAN, keys.Kind.JOB_HISTORY: Kind.PLAN_HISTORY,
    keys.Kind.JOB_ACK: Kind.ACK, keys.Kind.JOB_OVERRIDE: Kind.JOB_OVERRIDE,
    keys.Kind.POWER: Kind.POWER, keys.Kind.EVENT: Kind.EVENT, keys.Kind.LEADER: Kind.LEADER,
}


def classify(key: str, revision: int, deleted: bool = False) -> Change:
    """The change record of one etcd key (pure)."""
    k = keys.parse(key)
    kind = _KINDS.get(k.kind) if k is not None else None
    if kind is None:
        return _other(revision, deleted)
    name = str(k.number) if kind is Kind.EVENT else k.name
    return Change(kind, name, revision, deleted)


def _other(revision: int, deleted: bool) -> Change:
    return Change(Kind.OTHER, "", revision, deleted)


Handler = Callable[[list[Change]], None]
Unsubscribe = Callable[[], None]


class ChangeFeed(Protocol):
    def subscribe(self, handler: Handler) -> Unsubscribe: ...


class Subscribers:
    """The handler list a feeder keeps (thread-safe); ``publish`` calls each handler."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handlers: list[Handler] = []

    def subscribe(self, handler: Handler) -> Unsubscribe:
        with self._lock:
            self._handlers.append(handler)

        def unsubscribe() -> None:
            with self._lock:
                if handler in self._handlers:
                    self._handlers.remove(handler)

        return unsubscribe

    def __len__(self) -> int:
        with self._lock:
            return len(self._handlers)

    def publish(self, changes: list[Change]) -> None:
        if not changes:
            return
        with self._lock:
            handlers = list(self._handlers)
        for handler in handlers:
            try:
                handler(changes)
            except Exception as exc:  # a subscriber's bug must not stop the feeder
                log.error("change handler failed handler=%r error=%r", handler, exc)
