"""Pushing power plans to node agents (gRPC ``Agent.ApplyPowerPlan``), off the loop.

:meth:`AgentPusher.push` returns at once; the newest plan of each node is sent by a small
thread pool and retried with exponential backoff until the agent applies it, a newer plan
supersedes it, or the agent refuses it for good (a stale or invalid plan). Each outcome is
reported through ``on_result``. Sends are idempotent: the agent keys them by generation.

Channels to agents are pooled by address, at most ``max_channels`` (least recently used
closed first) and each closed after ``channel_idle_s`` without a send (settings
``agents.max_channels``, ``agents.channel_idle_s``): a channel keeps gRPC's connection
state and reconnect timers, so one per agent ever pushed to grew the controller's memory
with the fleet (tens of MB at 10,000 unreachable agents). Besides, a channel whose last
send could not reach its agent (UNAVAILABLE, DEADLINE_EXCEEDED) is closed as soon as no send
uses it: the retry after the backoff opens a new one, so agents that are down or gone hold
no channel between their retries (under the load bench, whose agents are all unreachable,
the pool sat at its bound). A channel in use is never closed;
a send after a close opens a new one. A send is handed to the worker pool only when a
worker is free: sends that are due wait in the schedule (one per node), so retries to
unreachable agents neither pile up as queued futures nor hold back a new plan's send.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from tpflex_proto import agent_pb2, agent_pb2_grpc, backoff
from tpflex_proto.tls import ClientCertificateFiles

from tpflex_controller.cache import NodePower
from tpflex_controller.clock import SYSTEM_CLOCK, Clock
from tpflex_controller.planbytes import apply_request_wire

log = logging.getLogger(__name__)

_RETRY_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.ABORTED,
}
# a send failed with these never reached the agent: its channel is not kept
_UNREACHED_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
_OUTCOMES = agent_pb2.ApplyPowerPlanResponse.Outcome


@dataclass(frozen=True)
class PushResult:
    node: str
    generation: int
    ok: bool  # the agent holds this generation (applied, already applied or partial)
    outcome: str  # "APPLIED", "ALREADY_APPLIED", "PARTIAL" or the gRPC status code name
    detail: str
    attempts: int
    at: float  # wall-clock time of the outcome


@dataclass
class _Target:
    address: str
    generation: int
    # the encoded ApplyPowerPlanRequest: kept until the agent has it, which for agents that
    # are down is long (a decoded plan is ~1.2 KB of upb arena, this ~120 bytes)
    request: bytes
    attempts: int = 0
    in_flight: bool = False
    due: float = 0.0  # when its queued heap entry is due
    entry: int | None = None  # the sequence number of that entry (None: none queued)


class AgentPusher:
    def __init__(
        self,
        on_result: Callable[[PushResult], None],
        *,
        timeout: float = 2.0,
        max_workers: int = 8,
        backoff_initial: float = 0.1,
        backoff_max: float = 5.0,
        on_failure: Callable[[], None] | None = None,
        credentials: grpc.ChannelCredentials | ClientCertificateFiles | None = None,
        max_channels: int = 256,
        channel_idle_s: float = 60.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._on_result = on_result
        self._credentials = credentials
        self._on_failure = on_failure
        self._timeout = timeout
        self._backoff = (backoff_initial, backoff_max)
        self._targets: dict[str, _Target] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._pool_bounds(max_channels, channel_idle_s)
        self._clock = clock
        # address -> [channel, last use, sends in flight]; least recently used first
        self._channels: OrderedDict[str, list] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="agent-push")
        # a send is handed to the pool only when a worker is free: the sends due wait in
        # the heap (one per node), not as a growing queue of futures in the executor (which
        # also made a new plan's send wait behind every retry to an unreachable agent)
        self._slots = threading.Semaphore(max_workers)
        self._closed = False
        self._thread = threading.Thread(target=self._dispatch, name="agent-push", daemon=True)
        self._thread.start()

    # ---- API ----

    def push(self, node: str, address: str, plan: NodePower) -> None:
        """Send ``plan`` (the node's desired power: its generation and (GPU index, watts)
        caps) to ``node``'s agent at ``address`` ("" = not known yet)."""
        self.push_many([(node, address, plan)])

    def push_many(self, items: Iterable[tuple[str, str, NodePower]]) -> None:
        """``push`` of each (node, address, plan), queued under one hold of the lock: a
        commit's plans for a rack's 18 nodes wake the dispatcher once, not 18 times (each
        wake-up took the GIL from the thread making the next decision)."""
        ready = [(node, address, plan.generation, apply_request_wire(node, plan.generation, plan.caps))
                 for node, address, plan in items]
        with self._cv:
            for node, address, generation, data in ready:
                t = self._targets.get(node)
                if t is None:
                    t = self._targets[node] = _Target(address, generation, data)
                else:
                    t.address, t.generation, t.request, t.attempts = address or t.address, generation, data, 0
                if t.address:  # else set_address sends it (the dispatcher would drop the entry)
                    self._schedule(node, 0.0)

    def set_address(self, node: str, address: str) -> None:
        """A node (re-)registered: send its pending plan now."""
        with self._cv:
            t = self._targets.get(node)
            if t is not None and address:
                t.address, t.attempts = address, 0
                self._schedule(node, 0.0)

    def set_channel_bounds(self, max_channels: int, channel_idle_s: float) -> None:
        """The channel pool's bounds (``agents.max_channels``, ``agents.channel_idle_s``)."""
        with self._cv:
            self._pool_bounds(max_channels, channel_idle_s)
            self._trim_channels()

    def _pool_bounds(self, max_channels: int, channel_idle_s: float) -> None:
        if max_channels < 1 or channel_idle_s <= 0:
            raise ValueError("need max_channels >= 1 and channel_idle_s > 0")
        self._max_channels, self._channel_idle_s = max_channels, channel_idle_s

    def sending(self) -> int:
        """Sends handed to the worker pool and not finished (at most ``max_workers``)."""
        with self._cv:
            return sum(t.in_flight for t in self._targets.values())

    def channel_count(self) -> int:
        with self._cv:
            return len(self._channels)

    def pending(self) -> dict[str, int]:
        with self._cv:
            return {n: t.generation for n, t in self._targets.items()}

    def cancel_all(self) -> None:
        with self._cv:
            self._targets.clear()
            self._heap.clear()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._targets.clear()
            self._cv.notify_all()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._cv:
            for ch, _, _ in self._channels.values():
                ch.close()
            self._channels.clear()

    # ---- scheduling ----

    def _schedule(self, node: str, delay: float) -> None:
        """Queue a send to ``node``; one heap entry per node (an entry already queued as
        early or earlier covers it: it sends the latest plan), so that pushes faster than
        the workers send (agents down, a storm of plans) cannot grow the heap."""
        t = self._targets[node]
        due = self._clock.mono() + delay
        if t.entry is not None and t.due <= due:
            return
        t.due, t.entry = due, next(self._seq)  # an older, later entry is stale from now
        heapq.heappush(self._heap, (due, t.entry, node))
        self._cv.notify()

    def _dispatch(self) -> None:
        while True:
            while not self._slots.acquire(timeout=0.5):  # a free worker first
                if self._closed:
                    return
            with self._cv:
                while not self._closed:
                    now = self._clock.mono()
                    self._trim_channels()
                    if self._heap and self._heap[0][0] <= now:
                        break
                    wait = self._heap[0][0] - now if self._heap else self._channel_idle_s
                    self._cv.wait(min(wait, self._channel_idle_s))
                if self._closed:
                    self._slots.release()
                    return
                _, seq, node = heapq.heappop(self._heap)
                t = self._targets.get(node)
                if t is None or t.entry != seq:  # cancelled, or superseded by an earlier entry
                    self._slots.release()
                    continue
                t.entry = None
                if t.in_flight or not t.address:
                    self._slots.release()
                    continue
                t.in_flight = True
                t.attempts += 1
                send = (t.generation, t.request, t.address, t.attempts)
            self._pool.submit(self._attempt_in_slot, node, *send)

    def _attempt_in_slot(self, node: str, generation: int, request: bytes, address: str, attempts: int) -> None:
        try:
            self._attempt(node, generation, request, address, attempts)
        finally:
            self._slots.release()

    def _attempt(self, node: str, generation: int, request: bytes, address: str, attempts: int) -> None:
        req = agent_pb2.ApplyPowerPlanRequest.FromString(request)
        retry = unreached = False
        channel = self._channel(address)
        try:
            resp = agent_pb2_grpc.AgentStub(channel).ApplyPowerPlan(req, timeout=self._timeout)
            result = self._result(node, generation, True, _OUTCOMES.Name(resp.outcome), _errors(resp), attempts)
        except grpc.RpcError as exc:
            code = exc.code()
            retry, unreached = code in _RETRY_CODES, code in _UNREACHED_CODES
            detail = exc.details() or ""
            result = self._result(node, generation, False, code.name if code else "UNKNOWN", detail, attempts)
            if self._on_failure is not None:
                self._on_failure()
            log.log(
                logging.INFO if retry else logging.WARNING,
                "agent power push failed node=%s generation=%d code=%s attempt=%d detail=%s",
                node, generation, result.outcome, attempts, detail,
            )
        with self._cv:
            self._release(address, unreached)
            t = self._targets.get(node)
            if t is None:
                return  # cancelled
            t.in_flight = False
            if t.generation != generation:
                self._schedule(node, 0.0)  # superseded while in flight: send the newer one
                return
            if retry:
                lo, hi = self._backoff
                self._schedule(node, backoff.delay(attempts, lo, hi))
                return
            del self._targets[node]
        self._on_result(result)

    def _result(self, node, generation, ok, outcome, detail, attempts) -> PushResult:
        return PushResult(node, generation, ok, outcome, detail, attempts, self._clock.wall())

    def _channel(self, address: str) -> grpc.Channel:
        """The pooled channel to ``address``, counted in use until ``_release``."""
        with self._cv:
            entry = self._channels.get(address)
            if entry is None:
                options = [
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000),
                ]
                if self._credentials is not None:
                    ch = grpc.secure_channel(address, _current(self._credentials), options=options)
                else:
                    ch = grpc.insecure_channel(address, options=options)
                entry = self._channels[address] = [ch, 0.0, 0]
            self._channels.move_to_end(address)
            entry[1], entry[2] = self._clock.mono(), entry[2] + 1
            self._trim_channels()
            return entry[0]

    def _release(self, address: str, unreached: bool = False) -> None:
        """Under ``_cv``: one send on ``address``'s channel ended; ``unreached``: it did not
        reach the agent: the channel is closed unless another send still uses it."""
        entry = self._channels.get(address)
        if entry is not None:
            entry[1], entry[2] = self._clock.mono(), entry[2] - 1
            if unreached and not entry[2]:
                del self._channels[address]
                entry[0].close()
        self._trim_channels()

    def _trim_channels(self) -> None:
        """Under ``_cv``: close idle channels, least recently used first, while above the
        bound or idle for ``channel_idle_s``; channels in use stay."""
        now = self._clock.mono()
        excess = len(self._channels) - self._max_channels
        for address, (ch, used, busy) in list(self._channels.items()):
            if excess <= 0 and now - used < self._channel_idle_s:
                break  # the rest were used more recently
            if busy:
                continue
            del self._channels[address]
            ch.close()
            excess -= 1


def _errors(resp: agent_pb2.ApplyPowerPlanResponse) -> str:
    return "; ".join(f"gpu {g.index}: {g.error}" for g in resp.gpus if not g.ok and g.error)


def _current(credentials) -> grpc.ChannelCredentials:
    """Channel credentials, or the current ones of a provider that reads its files again
    when they change (tpflex_proto.tls.ClientCertificateFiles: a renewed client certificate
    reaches the next channel without a restart)."""
    get = getattr(credentials, "get", None)
    return get() if callable(get) else credentials
