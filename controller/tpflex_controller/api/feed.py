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


_PREFIXED = (
    (keys.RACKS, Kind.RACK), (keys.NODES, Kind.NODE), (keys.HEALTH, Kind.HEALTH),
    (keys.JOB_OVERRIDES, Kind.JOB_OVERRIDE), (keys.POWER, Kind.POWER), (keys.EVENTS, Kind.EVENT),
)
_JOB_PARTS = {"spec": Kind.JOB, "plan": Kind.PLAN}


def classify(key: str, revision: int, deleted: bool = False) -> Change:
    """The change record of one etcd key (pure)."""
    if key == keys.LEADER:
        return Change(Kind.LEADER, "", revision, deleted)
    if key.startswith(keys.GPU_OVERRIDES):
        node = key[len(keys.GPU_OVERRIDES):].rpartition("/")[0]
        return Change(Kind.GPU_OVERRIDE, node, revision, deleted) if node else _other(revision, deleted)
    for prefix, kind in _PREFIXED:
        if key.startswith(prefix) and len(key) > len(prefix):
            name = key[len(prefix):]
            if kind is Kind.EVENT:
                name = str(int(name)) if name.isdigit() else ""
            return Change(kind, name, revision, deleted)
    split = keys.split_job_key(key)
    if split is not None:
        job, rest = split
        if rest in _JOB_PARTS:
            return Change(_JOB_PARTS[rest], job, revision, deleted)
        if rest.startswith("acks/"):
            return Change(Kind.ACK, job, revision, deleted)
        if rest.startswith("history/"):
            return Change(Kind.PLAN_HISTORY, job, revision, deleted)
    return _other(revision, deleted)


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
