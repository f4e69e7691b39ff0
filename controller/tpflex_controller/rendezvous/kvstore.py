"""The rendezvous store's operations on etcd, with c10d Store semantics.

``EtcdKvStore`` holds no state of its own beyond caches: every replica can serve every
call. Writes are bound to the job's lease (:mod:`.leases`); read-modify-write operations
(add, compare_set) are compare-and-swap loops on the key's mod revision, serialised per
key inside one replica so that contention is between replicas, not between calls.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import zlib
from collections.abc import Callable, Sequence

from tpflex_proto import keys
from tpflex_proto.etcd import Cmp, Etcd, EtcdError, Op

from tpflex_controller.rendezvous.leases import JobLeases
from tpflex_controller.rendezvous.limits import (
    RendezvousLimits,
    StoreError,
    StoreErrorCode,
    check_job,
    check_key,
    check_keys,
    check_value,
    parse_counter,
)

log = logging.getLogger(__name__)

_TXN_READS = 64  # keys read per transaction (etcd's default --max-txn-ops is 128)
_STRIPES = 64
_KNOWN_JOB_S = 5.0


class EtcdKvStore:
    def __init__(self, etcd: Etcd, limits: RendezvousLimits,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.etcd, self.limits, self._clock = etcd, limits, clock
        self.leases = JobLeases(etcd, limits.ttl_s, clock)
        self._stripes = [threading.Lock() for _ in range(_STRIPES)]
        self._known: dict[str, float] = {}

    # ---- checks ----

    def require_job(self, job: str) -> None:
        """INVALID_ARGUMENT for a malformed name, NOT_FOUND for a job not registered."""
        check_job(job)
        seen = self._known.get(job)
        if seen is not None and self._clock() - seen < _KNOWN_JOB_S:
            return
        if self.etcd.get(keys.job_spec(job)) is None:
            raise StoreError(StoreErrorCode.NOT_FOUND, f"unknown job {job!r} (register it first)")
        if len(self._known) > 4096:
            self._known.clear()
        self._known[job] = self._clock()

    def _room(self, job: str) -> None:
        if self.etcd.count_prefix(keys.rendezvous_keys(job)) >= self.limits.max_keys:
            raise StoreError(StoreErrorCode.RESOURCE_EXHAUSTED,
                             f"job {job!r} holds {self.limits.max_keys} rendezvous keys (the limit)")

    def _stripe(self, job: str, key: str) -> threading.Lock:
        return self._stripes[zlib.crc32(f"{job}/{key}".encode()) % _STRIPES]

    def _with_lease(self, job: str, write: Callable[[int], object]):
        """Run ``write(lease)``; once more with a fresh lease if etcd says it expired."""
        try:
            return write(self.leases.lease(job))
        except EtcdError as exc:
            if "lease not found" not in str(exc):
                raise
            self.leases.forget(job)
            return write(self.leases.lease(job))

    # ---- c10d operations ----

    def set(self, job: str, key: str, value: bytes) -> None:
        check_key(key, self.limits)
        check_value(value, self.limits)
        self.require_job(job)
        k = keys.rendezvous_key(job, key)

        def write(lease: int) -> None:
            res = self.etcd.txn([Cmp.create_revision(k, ">", 0)], [Op.put(k, value, lease)])
            if not res.succeeded:  # a new key: within the job's bound?
                self._room(job)
                self.etcd.put(k, value, lease=lease)

        self._with_lease(job, write)

    def get(self, job: str, key: str) -> bytes | None:
        check_key(key, self.limits)
        self.require_job(job)
        kv = self.etcd.get(keys.rendezvous_key(job, key))
        return None if kv is None else kv.value

    def missing(self, job: str, names: Sequence[str]) -> list[str]:
        """The keys of ``names`` that do not exist (checked in batches, stops at none)."""
        out = []
        for i in range(0, len(names), _TXN_READS):
            batch = names[i:i + _TXN_READS]
            res = self.etcd.txn([], [Op.get(keys.rendezvous_key(job, n), keys_only=True) for n in batch])
            out.extend(n for n, found in zip(batch, res.reads, strict=True) if not found)
        return out

    def check(self, job: str, names: Sequence[str]) -> bool:
        check_keys(names, self.limits)
        self.require_job(job)
        return not self.missing(job, names)

    def add(self, job: str, key: str, delta: int) -> int:
        check_key(key, self.limits)
        self.require_job(job)
        k = keys.rendezvous_key(job, key)

        def attempt(lease: int) -> int | None:
            kv = self.etcd.get(k)
            if kv is None:
                self._room(job)
                total, cmp = delta, Cmp.create_revision(k, "==", 0)
            else:
                total, cmp = parse_counter(kv.value, key) + delta, Cmp.mod_revision(k, "==", kv.mod_revision)
            ok = self.etcd.txn([cmp], [Op.put(k, str(total).encode(), lease)]).succeeded
            return total if ok else None

        return self._cas_loop(job, key, attempt)

    def compare_set(self, job: str, key: str, expected: bytes, desired: bytes) -> bytes:
        check_key(key, self.limits)
        check_value(expected, self.limits, "expected")
        check_value(desired, self.limits, "desired")
        self.require_job(job)
        k = keys.rendezvous_key(job, key)

        def attempt(lease: int) -> bytes | None:
            kv = self.etcd.get(k)
            if kv is None:
                if expected:
                    return expected  # c10d: a missing key answers the expected value
                self._room(job)
                cmp = Cmp.create_revision(k, "==", 0)
            elif kv.value != expected:
                return kv.value
            else:
                cmp = Cmp.mod_revision(k, "==", kv.mod_revision)
            ok = self.etcd.txn([cmp], [Op.put(k, desired, lease)]).succeeded
            return desired if ok else None

        return self._cas_loop(job, key, attempt)

    def _cas_loop(self, job: str, key: str, attempt: Callable[[int], object]):
        deadline = self._clock() + self.limits.cas_deadline_s
        pause = 0.002
        with self._stripe(job, key):
            while True:
                result = self._with_lease(job, attempt)
                if result is not None:
                    return result
                if self._clock() > deadline:
                    raise StoreError(StoreErrorCode.ABORTED,
                                     f"key {key!r} kept changing for {self.limits.cas_deadline_s:.0f}s; retry")
                time.sleep(random.uniform(0, pause))  # another replica won: jittered retry
                pause = min(pause * 2, 0.1)

    def delete_key(self, job: str, key: str) -> bool:
        check_key(key, self.limits)
        self.require_job(job)
        return self.etcd.delete(keys.rendezvous_key(job, key))

    def delete_prefix(self, job: str, prefix: str) -> int:
        check_key(prefix, self.limits, "key prefix")
        self.require_job(job)
        return self.etcd.delete_prefix(keys.rendezvous_key(job, prefix))

    def num_keys(self, job: str) -> int:
        self.require_job(job)
        return self.etcd.count_prefix(keys.rendezvous_keys(job))

    def keepalive(self, job: str) -> int:
        self.require_job(job)
        return self.leases.keepalive(job)
