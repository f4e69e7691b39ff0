"""Applies validated power plans to the backend and remembers what was applied."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .backend import ClockTarget, GpuBackend
from .errors import GpuError
from .plan import AppliedPlan, CapRequest, apply_order, resolve_plan

log = logging.getLogger(__name__)

APPLIED, ALREADY_APPLIED, PARTIAL = "APPLIED", "ALREADY_APPLIED", "PARTIAL"


@dataclass(frozen=True, slots=True)
class GpuApply:
    index: int
    ok: bool
    applied_cap_w: float
    locked_sm_clock_mhz: int
    error: str = ""


@dataclass(frozen=True)
class ApplyResult:
    generation: int
    outcome: str
    gpus: tuple[GpuApply, ...]


class PowerControl:
    """Thread-safe. Writes are skipped for GPUs already at their target (as last set by
    this agent, or as read from the device when not known: after a start, or when its
    limit was seen away from it), so re-applying a plan touches no device."""

    def __init__(self, backend: GpuBackend, node: str,
                 on_applied: Callable[[ApplyResult], None] | None = None) -> None:
        self.backend, self.node = backend, node
        self._devices = backend.devices()
        self._lock = threading.Lock()
        self._applied: AppliedPlan | None = None
        self._last_result: ApplyResult | None = None
        self._known: dict[int, ClockTarget] = {}  # what each GPU is known to be set to
        self._on_applied = on_applied
        self.regressions = 0  # authoritative plans older than the applied one

    @property
    def devices(self):
        return self._devices

    @property
    def applied_generation(self) -> int:
        with self._lock:
            return self._applied.generation if self._applied else 0

    def current_targets(self) -> dict[int, ClockTarget]:
        with self._lock:
            return dict(self._known)

    def apply(self, generation: int, caps: Sequence[CapRequest], *, source: str = "grpc",
              authoritative: bool = False, force: bool = False) -> ApplyResult:
        """Validate and apply a plan (see ``plan.resolve_plan``; ``authoritative``: etcd's
        desired state, applied even when older than the applied one). ``force``: write
        every GPU whose enforced limit, read from the device, is not its target (its limit
        was seen elsewhere), even one believed at its target.

        GPUs whose limit goes down are written before those whose limit goes up, judged by
        each GPU's current limit: as last set by this agent, else read from the device (after
        a restart the devices still hold their limits)."""
        with self._lock:
            res = resolve_plan(self.node, generation, caps, self._devices, self._applied,
                               authoritative=authoritative)
            if res.already_applied and self._last_result is not None and not force:
                return ApplyResult(generation, ALREADY_APPLIED, self._last_result.gpus)
            if res.regression:
                self.regressions += 1
                log.warning("desired power generation went back: applying it node=%s generation=%d "
                            "applied_generation=%d", self.node, generation, self._applied.generation)
            limits = self._current_limits(res.targets, force)
            statuses = tuple(self._apply_gpu(i, res.targets[i], limits.get(i))
                             for i in apply_order(res.targets, limits))
            complete = all(s.ok for s in statuses)
            self._applied = AppliedPlan(generation, res.targets, complete)
            result = ApplyResult(generation, APPLIED if complete else PARTIAL,
                                 tuple(sorted(statuses, key=lambda s: s.index)))
            self._last_result = result
        log.info("power plan applied node=%s generation=%d outcome=%s source=%s failed=%s",
                 self.node, generation, result.outcome, source,
                 [s.index for s in result.gpus if not s.ok])
        if self._on_applied:
            self._on_applied(result)
        return result

    def applied_targets(self) -> dict[int, ClockTarget]:
        with self._lock:
            return dict(self._applied.targets) if self._applied else {}

    def _current_limits(self, targets, force: bool) -> dict[int, float]:
        """Each target GPU's limit now: as last set by this agent, or read from the device
        when unknown (or ``force``); a GPU that cannot be read is left out."""
        limits = {}
        for i in targets:
            known = self._known.get(i)
            if known is not None and not force:
                limits[i] = known.cap_w
                continue
            try:
                limits[i] = self.backend.read(i).power_limit_w
            except GpuError:
                continue  # unknown: written (and its failure reported) like any other
        return limits

    def _apply_gpu(self, index: int, target: ClockTarget, limit: float | None) -> GpuApply:
        """``limit``: the GPU's current limit (None: unknown); the limit is written only
        when it is not the target (to the milliwatt NVML works in)."""
        known = self._known.get(index)
        cap = limit if limit is not None else 0.0
        locked = known.locked_sm_clock_mhz if known else 0
        try:
            if limit is None or round(limit * 1000) != round(target.cap_w * 1000):
                cap = self.backend.set_power_limit(index, target.cap_w)
                self._known[index] = ClockTarget(cap, locked)
            if known is None or known.locked_sm_clock_mhz != target.locked_sm_clock_mhz:
                if target.locked_sm_clock_mhz:
                    self.backend.lock_sm_clocks(index, target.locked_sm_clock_mhz)
                else:
                    self.backend.reset_sm_clocks(index)
                locked = target.locked_sm_clock_mhz
            self._known[index] = ClockTarget(target.cap_w, locked)
            return GpuApply(index, True, cap, locked)
        except GpuError as exc:
            self._known.pop(index, None)  # state unknown now: write again next time
            log.warning("power plan gpu failed node=%s gpu=%d code=%s error=%s",
                        self.node, index, exc.code.value, exc)
            return GpuApply(index, False, cap, locked, f"{exc.code.value}: {exc}")
