"""etcd's ``power/<node>`` is the authority on this node's caps.

:class:`PowerAuthority` applies the desired caps at start-up and whenever they change
(watch), re-reads them and checks the devices every ``check_s`` (level-triggered: a
missed event, an etcd restored from an older snapshot, a limit changed behind the agent's
back all converge within one check), and judges every pushed plan against them: a push
that is not exactly etcd's desired state (generation and caps) is refused and etcd's
state is applied instead. So no gRPC call can move a GPU away from the desired caps for
longer than a check, and a forged huge generation cannot wedge the agent: generations
order pushes, etcd decides.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.backoff import Backoff
from tpflex_proto.etcd import Etcd, EtcdError, WatchEvent

from .core import AgentCore
from .errors import AgentError, AgentErrorCode, GpuError
from .plan import CapRequest, divergent, plan_targets
from .power import ApplyResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Desired:
    generation: int  # 0 = no power/<node> key: every GPU at its default
    caps: tuple[CapRequest, ...]


NO_PLAN = Desired(0, ())


def desired_of(value: bytes | None, key: str) -> Desired | None:
    """The desired state in a ``power/<node>`` value (None = absent key -> defaults);
    None for a value that does not decode."""
    if value is None:
        return NO_PLAN
    try:
        plan = codec.decode(types_pb2.NodePowerPlan, value, key)
    except codec.MalformedValue as exc:
        log.warning("skipping malformed desired caps key=%s error=%s", key, exc)
        return None
    return Desired(plan.generation, tuple(
        CapRequest(c.gpu.node, c.gpu.index, c.cap_w, c.locked_sm_clock_mhz) for c in plan.caps))


class PowerAuthority:
    def __init__(self, etcd: Etcd, core: AgentCore, *, check_s: float = 5.0) -> None:
        self.etcd, self.core, self.check_s = etcd, core, check_s
        self.key = keys.power(core.node)
        self._lock = threading.Lock()
        self._desired: Desired | None = None  # None until etcd was read once
        self._rev = 0  # etcd mod revision of the desired state held (0: absent / unknown)
        self._serial = threading.RLock()  # one judgement or application at a time
        self.refused_pushes = 0
        self.corrections = 0  # GPUs re-written because their limit had left the desired cap
        self._bad: tuple[int, Desired] | None = None  # the last invalid desired value seen
        self._stop = threading.Event()
        self._watch = None
        self.ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="power-authority", daemon=True)

    def start(self) -> PowerAuthority:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._watch is not None:
            self._watch.cancel()

    @property
    def desired(self) -> Desired | None:
        with self._lock:
            return self._desired

    # ---- pushes (gRPC) ----

    def on_push(self, generation: int, caps: list[CapRequest]) -> ApplyResult:
        """Apply a pushed plan only if it is etcd's desired state; otherwise refuse it
        (NOT_DESIRED) and make sure etcd's state is what the devices have."""
        pushed = plan_targets(self.core.node, caps, self.core.power.devices)  # INVALID_ARGUMENT first
        with self._serial:
            try:
                kv = self.etcd.get(self.key)
            except EtcdError as exc:
                raise AgentError(AgentErrorCode.DESIRED_UNKNOWN,
                                 f"cannot read the desired caps from etcd to check the plan: {exc}") from None
            desired = desired_of(kv.value if kv is not None else None, self.key)
            if desired is None:
                raise AgentError(AgentErrorCode.DESIRED_UNKNOWN, "the desired caps in etcd do not decode")
            same = generation == desired.generation and pushed == self._targets(desired.caps)
            if not same:
                with self._lock:
                    self.refused_pushes += 1
                self._converge(desired, "push-refused", kv.mod_revision if kv else 0)
                raise AgentError(AgentErrorCode.NOT_DESIRED,
                                 f"plan generation {generation} is not the desired state in etcd "
                                 f"(generation {desired.generation}); etcd's caps stay applied")
            self._remember(desired, kv.mod_revision if kv else 0)
            return self.core.power.apply(generation, list(caps), source="grpc", authoritative=True)

    def _targets(self, caps) -> dict | None:
        try:
            return plan_targets(self.core.node, caps, self.core.power.devices)
        except AgentError:
            return None  # an invalid plan matches nothing

    # ---- etcd ----

    def _run(self) -> None:
        backoff = Backoff(0.1, 2.0)
        while not self._stop.is_set():
            try:
                kvs, rev = self.etcd.get_prefix(self.key)
                kv = next((kv for kv in kvs if kv.key == self.key), None)
                self._converge(desired_of(kv.value if kv else None, self.key), "startup",
                               kv.mod_revision if kv else 0)
                break
            except EtcdError as exc:
                log.info("desired caps not readable yet node=%s error=%s", self.core.node, exc)
                self._stop.wait(backoff.next())
        else:
            return
        self._watch = self.etcd.watch_prefix(self.key, self._on_events, start_revision=rev + 1,
                                             on_resync=lambda: self._check("resync"))
        self.ready.set()
        while not self._stop.wait(self.check_s):
            self._check("check")

    def _on_events(self, events: list[WatchEvent]) -> None:
        for ev in events:
            if ev.key == self.key and ev.mod_revision >= self._rev:  # never behind a read
                value = ev.value if ev.kind == "put" else None
                self._converge(desired_of(value, self.key), "watch", ev.mod_revision)

    def _check(self, source: str) -> None:
        """Re-read etcd (the truth now, even if its revisions went back) and converge."""
        try:
            kv = self.etcd.get(self.key)
        except EtcdError as exc:
            log.info("desired caps re-read failed node=%s error=%s", self.core.node, exc)
            return
        self._converge(desired_of(kv.value if kv else None, self.key), source, kv.mod_revision if kv else 0)

    # ---- converging ----

    def _remember(self, desired: Desired | None, rev: int) -> Desired | None:
        with self._lock:
            if desired is not None:
                self._desired, self._rev = desired, rev
            return self._desired

    def _applicable(self, desired: Desired, rev: int) -> bool:
        """Whether ``desired`` is valid on this node's devices (else logged, once per value)."""
        try:
            plan_targets(self.core.node, list(desired.caps), self.core.power.devices)
        except AgentError as exc:
            if (rev, desired) != self._bad:
                self._bad = (rev, desired)
                log.warning("desired caps not applicable: the last good desired state stays node=%s "
                            "generation=%d code=%s reason=%s", self.core.node, desired.generation,
                            exc.code.value, exc.message)
            return False
        return True

    def _converge(self, desired: Desired | None, source: str, rev: int) -> None:
        """Make the devices hold ``desired`` (None, or a value not valid on this node's
        devices: keep the last good desired state, and converge on it).

        A new desired state is applied as a plan change (down before up, unchanged GPUs
        untouched); the same desired state again is a check: a GPU whose enforced limit
        has left it (changed behind the agent's back, a failed write) is written again and
        counted as a correction."""
        with self._serial:
            last = self.desired
            if desired is not None and not self._applicable(desired, rev):
                desired = None
            desired = self._remember(desired, rev)
            if desired is None:
                return
            force = desired == last and bool(self.divergent_gpus())
            try:
                result = self.core.power.apply(desired.generation, list(desired.caps),
                                               source=f"etcd-{source}", authoritative=True, force=force)
            except AgentError as exc:
                log.warning("desired caps not applicable node=%s generation=%d code=%s reason=%s",
                            self.core.node, desired.generation, exc.code.value, exc.message)
                return
        if force:
            with self._lock:
                self.corrections += 1
            log.warning("power limits had left the desired caps: re-applied node=%s generation=%d "
                        "source=%s outcome=%s", self.core.node, desired.generation, source, result.outcome)

    def divergent_gpus(self) -> list[int]:
        """GPUs whose enforced limit is not the desired cap now (read from the devices)."""
        desired = self.desired
        if desired is None:
            return []
        try:
            targets = plan_targets(self.core.node, list(desired.caps), self.core.power.devices)
        except AgentError:
            return []
        limits = {}
        for i in targets:
            try:
                limits[i] = self.core.backend.read(i).power_limit_w
            except GpuError:
                continue  # an unreadable GPU is the health monitor's business
        return divergent(targets, limits)
