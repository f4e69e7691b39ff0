"""``Rendezvous`` gRPC service (rendezvous.proto) over :class:`EtcdKvStore`.

Domain errors map once here: INVALID_ARGUMENT (malformed or oversized input), NOT_FOUND
(unknown job), RESOURCE_EXHAUSTED (the job's key bound), FAILED_PRECONDITION (add on a
non-integer), ABORTED (compare-and-swap contention), UNAVAILABLE (etcd unreachable).
Get and Wait park the call up to ``min(wait_ms, max_wait_s)`` on the job's watch; at most
``max_parked`` calls are parked at once, further ones answer ``busy`` after one read so
that parked calls never starve the plan streams of the server's worker threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import grpc
from tpflex_proto import keys, rendezvous_pb2, rendezvous_pb2_grpc
from tpflex_proto.etcd import Etcd, EtcdError, EtcdUnavailable

from tpflex_controller.rendezvous.kvstore import EtcdKvStore
from tpflex_controller.rendezvous.limits import (
    RendezvousLimits,
    StoreError,
    StoreErrorCode,
    check_keys,
)
from tpflex_controller.rendezvous.waiters import KeyWaiters

log = logging.getLogger(__name__)

_STATUS = {
    StoreErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    StoreErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    StoreErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    StoreErrorCode.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    StoreErrorCode.ABORTED: grpc.StatusCode.ABORTED,
}

pb = rendezvous_pb2


class RendezvousServicer(rendezvous_pb2_grpc.RendezvousServicer):
    def __init__(self, etcd: Etcd, limits: RendezvousLimits = RendezvousLimits(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.store = EtcdKvStore(etcd, limits, clock)
        self.waiters = KeyWaiters(etcd, clock=clock)
        self._parked = threading.BoundedSemaphore(max(limits.max_parked, 1))
        self._park_enabled = limits.max_parked > 0
        self._clock = clock

    def close(self) -> None:
        self.waiters.close()

    def _run(self, context, fn: Callable, *args):
        try:
            return fn(*args)
        except StoreError as exc:
            context.abort(_STATUS[exc.code], exc.message)
        except EtcdUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd unavailable: {exc}")
        except EtcdError as exc:
            log.warning("rendezvous etcd error error=%s", exc)
            context.abort(grpc.StatusCode.INTERNAL, f"etcd error: {exc}")

    # ---- waiting ----

    def _await(self, job: str, names: Sequence[str], wait_ms: int) -> tuple[bool, bool]:
        """(all present, busy): wait up to wait_ms (capped) for every key of ``names``."""
        if not self.store.missing(job, names):
            return True, False
        wait_s = min(wait_ms / 1000.0, self.limits.max_wait_s)
        if wait_s <= 0:
            return False, False
        if not (self._park_enabled and self._parked.acquire(blocking=False)):
            return False, True
        try:
            etcd_keys = [keys.rendezvous_key(job, n) for n in names]
            event = self.waiters.register(job, etcd_keys)
            try:
                deadline = self._clock() + wait_s
                while True:
                    event.clear()
                    pending = self.store.missing(job, names)
                    remaining = deadline - self._clock()
                    if not pending or remaining <= 0:
                        return not pending, False
                    names = pending
                    event.wait(remaining)
            finally:
                self.waiters.unregister(job, etcd_keys, event)
        finally:
            self._parked.release()

    def _get(self, r: pb.StoreGetRequest) -> pb.StoreGetResponse:
        value = self.store.get(r.job, r.key)
        if value is None and r.wait_ms:
            present, busy = self._await(r.job, [r.key], r.wait_ms)
            if not present:
                return pb.StoreGetResponse(found=False, busy=busy)
            value = self.store.get(r.job, r.key)
        if value is None:  # deleted again between the wake-up and the read
            return pb.StoreGetResponse(found=False)
        return pb.StoreGetResponse(found=True, value=value)

    def _wait(self, r: pb.StoreWaitRequest) -> pb.StoreWaitResponse:
        check_keys(list(r.keys), self.limits)
        self.store.require_job(r.job)
        present, busy = self._await(r.job, list(r.keys), r.wait_ms)
        return pb.StoreWaitResponse(all_present=present, busy=busy)

    # ---- RPCs ----

    def Set(self, request, context):
        self._run(context, self.store.set, request.job, request.key, request.value)
        return pb.StoreSetResponse()

    def Get(self, request, context):
        return self._run(context, self._get, request)

    def Add(self, request, context):
        return pb.StoreAddResponse(value=self._run(context, self.store.add, request.job, request.key,
                                                   request.delta))

    def Check(self, request, context):
        present = self._run(context, self.store.check, request.job, list(request.keys))
        return pb.StoreCheckResponse(all_present=present)

    def Wait(self, request, context):
        return self._run(context, self._wait, request)

    def CompareSet(self, request, context):
        value = self._run(context, self.store.compare_set, request.job, request.key,
                          request.expected, request.desired)
        return pb.StoreCompareSetResponse(value=value)

    def DeleteKey(self, request, context):
        deleted = self._run(context, self.store.delete_key, request.job, request.key)
        return pb.StoreDeleteResponse(deleted=int(deleted))

    def DeletePrefix(self, request, context):
        deleted = self._run(context, self.store.delete_prefix, request.job, request.key)
        return pb.StoreDeleteResponse(deleted=deleted)

    def NumKeys(self, request, context):
        return pb.StoreNumKeysResponse(count=self._run(context, self.store.num_keys, request.job))

    def KeepAlive(self, request, context):
        return pb.StoreKeepAliveResponse(ttl_s=self._run(context, self.store.keepalive, request.job))


def add_rendezvous(server: grpc.Server, etcd: Etcd,
                   limits: RendezvousLimits = RendezvousLimits()) -> RendezvousServicer:
    """Serve ``Rendezvous`` on ``server`` (before it starts); returns the servicer."""
    servicer = RendezvousServicer(etcd, limits)
    rendezvous_pb2_grpc.add_RendezvousServicer_to_server(servicer, server)
    return servicer
