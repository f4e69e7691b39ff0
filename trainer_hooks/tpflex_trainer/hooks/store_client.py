"""Client of the controller's ``Rendezvous`` service (rendezvous.proto), without torch.

One call = one c10d store operation. Calls go to the configured controller endpoints with
the plan stream's TLS settings, moving to the next endpoint when one is unreachable and
retrying with jittered backoff until the caller's deadline: any controller replica can
serve any call. Refusals (bad input, unknown job, a full key space) raise
:class:`StoreRefused` at once with the server's message.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import grpc
from tpflex_proto import rendezvous_pb2 as pb
from tpflex_proto import rendezvous_pb2_grpc
from tpflex_proto.backoff import Backoff

from tpflex_trainer.hooks.control import ControlConfig, open_channel

log = logging.getLogger(__name__)

STORE_SCHEME = "tpflex://"  # TPFLEX_STORE=tpflex://[HOST:PORT,...]: this service
_RETRY = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED}
WAIT_SLICE_S = 5.0  # one parked Get/Wait call (the server caps it too)
STOPPABLE_SLICE_S = 0.5  # the same, while the caller may give up (a rendezvous a newer plan ends)


class StoreRefused(RuntimeError):
    """The rendezvous service refused a call; ``code`` is the gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class StoreInputError(StoreRefused, ValueError):
    """Refused for its input (INVALID_ARGUMENT, or add() on a non-integer value: c10d's
    stores raise ValueError there too)."""


_INPUT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}


class StoreUnreachable(TimeoutError):
    """No controller endpoint answered before the deadline."""


class RendezvousClient:
    def __init__(self, config: ControlConfig) -> None:
        if not config.endpoints:
            raise ValueError("at least one controller endpoint is required")
        self.config = config
        self.job = config.job
        self._lock = threading.Lock()
        self._stubs: dict[str, rendezvous_pb2_grpc.RendezvousStub] = {}
        self._channels: list[grpc.Channel] = []
        self._current = 0
        self._closed = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for ch in self._channels:
                ch.close()
            self._channels.clear()
            self._stubs.clear()

    def _stub(self, endpoint: str) -> rendezvous_pb2_grpc.RendezvousStub:
        with self._lock:
            if self._closed:
                raise StoreUnreachable("rendezvous client closed")
            stub = self._stubs.get(endpoint)
            if stub is None:
                ch = open_channel(self.config, endpoint)
                self._channels.append(ch)
                stub = self._stubs[endpoint] = rendezvous_pb2_grpc.RendezvousStub(ch)
            return stub

    def call(self, method: str, request, deadline: float, extra_s: float = 0.0):
        """``method`` on the first endpoint that answers; retried until ``deadline``
        (monotonic). ``extra_s``: how long the server may legitimately hold the call."""
        backoff = Backoff(self.config.backoff_initial_s, self.config.backoff_max_s)
        endpoints = self.config.endpoints
        while True:
            endpoint = endpoints[self._current % len(endpoints)]
            timeout = max(0.05, min(self.config.call_timeout_s + extra_s, deadline - time.monotonic()))
            try:
                return getattr(self._stub(endpoint), method)(request, timeout=timeout)
            except grpc.RpcError as exc:
                code = exc.code()
                if code not in _RETRY:
                    kind = StoreInputError if code in _INPUT_CODES else StoreRefused
                    raise kind(code, f"rendezvous {method} refused: {code.name}: {exc.details()}") from None
                if code != grpc.StatusCode.ABORTED:
                    self._current += 1  # try the next replica
                pause = backoff.next()
                if time.monotonic() + pause > deadline:
                    raise StoreUnreachable(
                        f"rendezvous {method}: no controller answered ({code.name}: {exc.details()}) "
                        f"at {','.join(endpoints)}"
                    ) from None
                log.debug("rendezvous call retried method=%s endpoint=%s code=%s", method, endpoint, code.name)
                time.sleep(pause)

    # ---- operations (deadline: monotonic seconds) ----

    def set(self, key: str, value: bytes, deadline: float) -> None:
        self.call("Set", pb.StoreSetRequest(job=self.job, key=key, value=value), deadline)

    def get(self, key: str, deadline: float, stop: Callable[[], bool] | None = None) -> bytes | None:
        """The value, or None when it did not appear before ``deadline`` (or ``stop()``
        turned true: checked between shorter parked calls)."""
        backoff = Backoff(self.config.backoff_initial_s, self.config.backoff_max_s)
        while True:
            if stop is not None and stop():
                return None
            wait_s = max(0.0, min(STOPPABLE_SLICE_S if stop else WAIT_SLICE_S, deadline - time.monotonic()))
            r = self.call("Get", pb.StoreGetRequest(job=self.job, key=key, wait_ms=int(wait_s * 1000)),
                          deadline + self.config.call_timeout_s, extra_s=wait_s)
            if r.found:
                return r.value
            if time.monotonic() >= deadline:
                return None
            if r.busy:  # the server parks no more calls: poll gently
                time.sleep(backoff.next())

    def wait(self, keys: Sequence[str], deadline: float, stop: Callable[[], bool] | None = None) -> bool:
        backoff = Backoff(self.config.backoff_initial_s, self.config.backoff_max_s)
        while True:
            if stop is not None and stop():
                return False
            wait_s = max(0.0, min(STOPPABLE_SLICE_S if stop else WAIT_SLICE_S, deadline - time.monotonic()))
            r = self.call("Wait", pb.StoreWaitRequest(job=self.job, keys=list(keys), wait_ms=int(wait_s * 1000)),
                          deadline + self.config.call_timeout_s, extra_s=wait_s)
            if r.all_present:
                return True
            if time.monotonic() >= deadline:
                return False
            if r.busy:
                time.sleep(backoff.next())

    def add(self, key: str, delta: int, deadline: float) -> int:
        return self.call("Add", pb.StoreAddRequest(job=self.job, key=key, delta=delta), deadline).value

    def check(self, keys: Sequence[str], deadline: float) -> bool:
        return self.call("Check", pb.StoreKeysRequest(job=self.job, keys=list(keys)), deadline).all_present

    def compare_set(self, key: str, expected: bytes, desired: bytes, deadline: float) -> bytes:
        req = pb.StoreCompareSetRequest(job=self.job, key=key, expected=expected, desired=desired)
        return self.call("CompareSet", req, deadline).value

    def delete_key(self, key: str, deadline: float) -> bool:
        return self.call("DeleteKey", pb.StoreKeyRequest(job=self.job, key=key), deadline).deleted > 0

    def delete_prefix(self, prefix: str, deadline: float) -> int:
        return self.call("DeletePrefix", pb.StoreKeyRequest(job=self.job, key=prefix), deadline).deleted

    def num_keys(self, deadline: float) -> int:
        return self.call("NumKeys", pb.StoreJobRequest(job=self.job), deadline).count

    def keepalive(self, deadline: float) -> int:
        return self.call("KeepAlive", pb.StoreJobRequest(job=self.job), deadline).ttl_s
