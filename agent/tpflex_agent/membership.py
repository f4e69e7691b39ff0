"""Node membership in etcd: the lease-bound ``nodes/<node>`` registration and the
``health/<node>`` record (the desired caps, ``power/<node>``, are ``desired.py``'s).

The registration and the health record share one lease (TTL ``lease_ttl_s``, kept alive
every TTL/3, a failed keep-alive retried after a short back-off): when the agent dies both
vanish after the TTL. After an etcd outage that outlived the lease the agent registers
again under a new lease.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.backoff import Backoff
from tpflex_proto.etcd import Etcd, EtcdError, EtcdUnavailable, Op

from .core import AgentCore

log = logging.getLogger(__name__)


class Membership:
    def __init__(
        self, etcd: Etcd, core: AgentCore, *, agent_address: str, metrics_address: str = "",
        ttl_s: int = 5, clock: Callable[[], float] = time.time,
        registered: threading.Event | None = None,
    ) -> None:
        self.etcd, self.core = etcd, core
        self.agent_address, self.metrics_address = agent_address, metrics_address
        self.ttl_s, self._clock = ttl_s, clock
        self._lock = threading.Lock()
        self._lease = 0
        self._abandoned = 0  # a lease given up during an outage, revoked once back
        self._health: types_pb2.NodeHealth | None = None
        self._stop = threading.Event()
        self.registered = registered if registered is not None else threading.Event()
        self.registrations = 0
        self._thread = threading.Thread(target=self._run, name="membership", daemon=True)

    @property
    def lease_id(self) -> int:
        with self._lock:
            return self._lease

    def start(self) -> Membership:
        self._health = self.core.monitor.snapshot()
        self.core.monitor.add_sink(self._on_health)
        self._thread.start()
        return self

    def stop(self, revoke: bool = True) -> None:
        self._stop.set()
        self.core.monitor.remove_sink(self._on_health)
        self._thread.join(timeout=5)
        lease = self.lease_id
        if revoke and lease:
            try:
                self.etcd.revoke_lease(lease)
                log.info("lease revoked node=%s lease=%x", self.core.node, lease)
            except EtcdError as exc:
                log.warning("lease revoke failed node=%s error=%s", self.core.node, exc)
        self.registered.clear()

    # ---- registration ----

    def _node_record(self) -> types_pb2.Node:
        return types_pb2.Node(
            name=self.core.node, rack=self.core.rack, agent_address=self.agent_address,
            gpus=self.core.devices(), registered_at=self._clock(), backend=self.core.backend.kind,
            metrics_address=self.metrics_address, rack_source=self.core.rack_choice.source,
        )

    def _register(self) -> None:
        lease = self.etcd.grant_lease(self.ttl_s)
        with self._lock:
            health = self._health
            ops = [Op.put(keys.node(self.core.node), codec.encode(self._node_record()), lease)]
            if health is not None:
                ops.append(Op.put(keys.health(self.core.node), codec.encode(health), lease))
            self.etcd.txn([], ops)
            self._lease = lease
        self.registrations += 1
        self.registered.set()
        old, self._abandoned = self._abandoned, 0
        if old:
            try:
                self.etcd.revoke_lease(old)
            except EtcdError as exc:
                log.info("old lease not revoked node=%s lease=%x error=%s", self.core.node, old, exc)
        log.info("node registered node=%s rack=%s lease=%x ttl_s=%d", self.core.node,
                 self.core.rack, lease, self.ttl_s)

    def _run(self) -> None:
        """Register, then refresh the lease every TTL/3 until stopped.

        A failed keep-alive is retried after the back-off alone, not after the back-off and
        another TTL/3: with the default TTL 5 s and a 2 s call deadline, one keep-alive that
        timed out would otherwise put the next refresh past the TTL, and the node would drop
        out of the cluster (and the controller replan) on a single etcd blip. While the
        lease is held the pause is also capped at TTL/6, so that several retries fit in the
        two thirds of the TTL left after the failed refresh. Every success resets the
        back-off: blips spread over the agent's life must not add up to long pauses.
        """
        backoff, last_ok = Backoff(0.1, max(self.ttl_s / 3, 0.2)), time.monotonic()
        pause = 0.0  # register at once
        while not self._stop.wait(pause):
            try:
                if not self.lease_id:
                    self._register()
                elif self.etcd.keepalive_once(self.lease_id) <= 0:
                    log.warning("lease expired node=%s lease=%x", self.core.node, self.lease_id)
                    self._drop_lease()
                    pause = 0.0  # register again under a new lease at once
                    continue
                last_ok, pause = time.monotonic(), self.ttl_s / 3
                backoff.reset()
            except EtcdError as exc:
                if time.monotonic() - last_ok > self.ttl_s and self.lease_id:
                    log.warning("lease presumed lost node=%s error=%s", self.core.node, exc)
                    self._drop_lease()
                level = logging.INFO if isinstance(exc, EtcdUnavailable) else logging.WARNING
                log.log(level, "etcd unreachable node=%s error=%s", self.core.node, exc)
                pause = backoff.next()
                if self.lease_id:  # a keep-alive retry: well inside what is left of the lease
                    pause = min(pause, self.ttl_s / 6)

    def _drop_lease(self) -> None:
        with self._lock:
            self._abandoned = self._lease or self._abandoned
            self._lease = 0
        self.registered.clear()

    # ---- health ----

    def _on_health(self, msg: types_pb2.NodeHealth, critical: bool) -> None:
        with self._lock:
            self._health = msg
            lease = self._lease
            if not lease:
                return  # written with the next registration
            try:
                self.etcd.put(keys.health(self.core.node), codec.encode(msg), lease=lease)
            except EtcdError as exc:
                log.warning("health write failed node=%s seq=%d critical=%s error=%s",
                            self.core.node, msg.seq, critical, exc)
