"""One etcd lease per job's rendezvous store, shared by every controller replica.

The lease id is stored under ``rendezvous/v1/<job>/lease``, bound to the lease itself, so
the whole store (that key and every ``kv/`` key) vanishes ``ttl_s`` after the last
refresh. A replica creates the lease when none exists (a compare-and-swap on the lease
key: one lease per job even when replicas race) and refreshes it at most every ttl/3.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tpflex_proto import keys
from tpflex_proto.etcd import Cmp, Etcd, EtcdError, Op

log = logging.getLogger(__name__)

_MAX_CACHED = 4096


@dataclass
class _Held:
    lease: int
    refreshed: float


class JobLeases:
    def __init__(self, etcd: Etcd, ttl_s: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.etcd, self.ttl_s, self._clock = etcd, ttl_s, clock
        self._held: dict[str, _Held] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def _job_lock(self, job: str) -> threading.Lock:
        with self._lock:
            if len(self._locks) > _MAX_CACHED:
                self._prune()
            return self._locks.setdefault(job, threading.Lock())

    def _prune(self) -> None:
        """Forget jobs not used for a TTL (their leases are gone or kept by others)."""
        now = self._clock()
        for job in [j for j, h in self._held.items() if now - h.refreshed > self.ttl_s]:
            self._held.pop(job, None)
            self._locks.pop(job, None)

    def lease(self, job: str) -> int:
        """The job's live lease id (created or refreshed as needed)."""
        with self._job_lock(job):
            held = self._held.get(job)
            if held is not None and self._clock() - held.refreshed < self.ttl_s / 3:
                return held.lease
            return self._refresh_or_create(job, held)

    def keepalive(self, job: str) -> int:
        """Refresh now; returns the TTL granted (seconds)."""
        with self._job_lock(job):
            self._refresh_or_create(job, self._held.get(job))
            return self.ttl_s

    def forget(self, job: str) -> None:
        """The cached lease was refused by etcd (expired): look it up again next time."""
        with self._lock:
            self._held.pop(job, None)

    def _refresh_or_create(self, job: str, held: _Held | None) -> int:
        if held is not None and self.etcd.keepalive_once(held.lease) > 0:
            held.refreshed = self._clock()
            return held.lease
        for _ in range(5):
            lease = self._adopt_or_create(job)
            if lease:
                with self._lock:
                    self._held[job] = _Held(lease, self._clock())
                return lease
        raise EtcdError(f"rendezvous lease of job {job} could not be established")

    def _adopt_or_create(self, job: str) -> int:
        key = keys.rendezvous_lease(job)
        kv = self.etcd.get(key)
        if kv is not None:
            try:
                lease = int(kv.value.decode())
            except ValueError:
                lease = 0
            if lease and self.etcd.keepalive_once(lease) > 0:
                return lease
            return 0  # expiring right now: its key goes with it; try again
        lease = self.etcd.grant_lease(self.ttl_s)
        res = self.etcd.txn([Cmp.create_revision(key, "==", 0)],
                            [Op.put(key, str(lease).encode(), lease)])
        if res.succeeded:
            log.info("rendezvous lease created job=%s lease=%x ttl_s=%d", job, lease, self.ttl_s)
            return lease
        self.etcd.revoke_lease(lease)  # another replica won the race: adopt its lease
        return 0
