"""Simulated GPUs for machines without any: a physical model plus fault injection.

Power cap -> SM clock -> relative throughput follows ``tpflex_proto.powermodel``
(the table the planner uses): unlocked, a GPU capped at ``r`` x TDP runs its SM clock at
``nominal_clock x model.throughput(r)`` and so delivers ``model.throughput(r)``. Locked
clocks below that lower the clock and the draw (``model.power_for``). Faults: XID 79
(falls off the bus: lost until recovered), XID 48 (double-bit ECC), thermal throttling,
a slow GPU, recovery.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from tpflex_proto.powermodel import DEFAULT_POWER_MODEL, PowerModel

from .backend import (
    THROTTLE_HW_THERMAL,
    THROTTLE_SW_POWER_CAP,
    THROTTLE_SW_THERMAL,
    DeviceInfo,
    FabricInfo,
    GpuEvent,
    GpuEventKind,
    GpuReading,
)
from .errors import AgentError, AgentErrorCode, GpuError, GpuErrorCode

FAULT_KINDS = ("xid79", "xid48", "thermal", "slow", "recover")
THERMAL_SPEED = 0.7     # clock factor while thermally throttled
THERMAL_TEMP_C = 92.0
NVLINKS_PER_GPU = 18


@dataclass(frozen=True)
class SimGpuSpec:
    tdp_w: float = 700.0
    min_limit_w: float = 200.0
    nominal_sm_clock_mhz: int = 1700   # SM clock at TDP under load
    max_sm_clock_mhz: int = 1980
    name: str = "tpflex simulated GPU"


@dataclass
class _SimGpu:
    limit_w: float
    locked_mhz: int = 0
    lost: bool = False
    thermal: bool = False
    slow_factor: float = 1.0
    dbe: int = 0
    deny_writes: bool = False
    writes: int = 0


class SimulatedBackend:
    """N virtual GPUs. Thread-safe."""

    kind = "sim"

    def __init__(
        self, count: int, *, spec: SimGpuSpec = SimGpuSpec(),
        model: PowerModel = DEFAULT_POWER_MODEL, node: str = "sim",
        fabric: FabricInfo | None = None,
    ) -> None:
        """``fabric``: the NVLink fabric every GPU reports (None: no fabric, as on HGX)."""
        if count < 1:
            raise ValueError("a simulated node needs at least one GPU")
        self.spec, self.model, self.node = spec, model, node
        self._fabric = fabric
        self.max_limit_w = spec.tdp_w * model.max_power_ratio
        self._gpus = [_SimGpu(limit_w=spec.tdp_w) for _ in range(count)]
        self._cond = threading.Condition()
        self._events: deque[GpuEvent] = deque()
        self.events_emitted = 0

    # ---- GpuBackend ----

    def devices(self) -> list[DeviceInfo]:
        return [
            DeviceInfo(
                index=i, uuid=f"GPU-sim-{self.node}-{i:04d}", name=self.spec.name,
                serial=f"SIM{i:08d}", default_limit_w=self.spec.tdp_w,
                min_limit_w=self.spec.min_limit_w, max_limit_w=self.max_limit_w,
                max_sm_clock_mhz=self.spec.max_sm_clock_mhz,
            )
            for i in range(len(self._gpus))
        ]

    def read(self, index: int) -> GpuReading:
        with self._cond:
            g = self._gpu(index)
            if g.lost:
                raise GpuError(GpuErrorCode.GPU_IS_LOST, "GPU has fallen off the bus", index)
            return self._reading(index, g)

    def fabric(self, index: int) -> FabricInfo | None:
        with self._cond:
            if self._gpu(index).lost:
                raise GpuError(GpuErrorCode.GPU_IS_LOST, "GPU has fallen off the bus", index)
            return self._fabric

    def set_fabric(self, fabric: FabricInfo | None) -> None:
        """Simulator control: what the GPUs report from now on (e.g. registration done)."""
        with self._cond:
            self._fabric = fabric

    def set_power_limit(self, index: int, watts: float) -> float:
        with self._cond:
            g = self._writable(index)
            if not self.spec.min_limit_w <= watts <= self.max_limit_w:
                raise GpuError(
                    GpuErrorCode.INVALID_ARGUMENT,
                    f"limit {watts:.1f} W outside [{self.spec.min_limit_w:.1f}, {self.max_limit_w:.1f}] W",
                    index,
                )
            g.limit_w = float(watts)
            g.writes += 1
            return g.limit_w

    def lock_sm_clocks(self, index: int, mhz: int) -> None:
        with self._cond:
            g = self._writable(index)
            if not 0 < mhz <= self.spec.max_sm_clock_mhz:
                raise GpuError(GpuErrorCode.INVALID_ARGUMENT, f"clock {mhz} MHz not supported", index)
            g.locked_mhz = int(mhz)
            g.writes += 1

    def reset_sm_clocks(self, index: int) -> None:
        with self._cond:
            g = self._writable(index)
            g.locked_mhz = 0
            g.writes += 1

    def wait_events(self, timeout_s: float) -> list[GpuEvent]:
        with self._cond:
            self._cond.wait_for(lambda: bool(self._events), timeout_s)
            out = list(self._events)
            self._events.clear()
            return out

    def close(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ---- simulator controls ----

    def inject_fault(self, index: int, kind: str, slow_factor: float = 0.0) -> int:
        """Apply a fault; returns ``events_emitted`` after it (see HealthMonitor.settle)."""
        if kind not in FAULT_KINDS:
            raise AgentError(
                AgentErrorCode.INVALID_ARGUMENT,
                f"unknown fault kind {kind!r}; expected one of {', '.join(FAULT_KINDS)}",
            )
        if kind == "slow" and not 0.0 < slow_factor < 1.0:
            raise AgentError(
                AgentErrorCode.INVALID_ARGUMENT,
                f"slow_factor must be in (0, 1), got {slow_factor!r}",
            )
        with self._cond:
            g = self._gpu(index)
            if kind == "xid79":
                g.lost = True
                self._emit(GpuEvent(index, GpuEventKind.XID, 79, "GPU has fallen off the bus"))
            elif kind == "xid48":
                g.dbe += 1
                self._emit(GpuEvent(index, GpuEventKind.DOUBLE_BIT_ECC, 48, "double-bit ECC error"))
            elif kind == "thermal":
                g.thermal = True
            elif kind == "slow":
                g.slow_factor = slow_factor
            else:
                g.lost, g.thermal, g.slow_factor, g.dbe = False, False, 1.0, 0
            return self.events_emitted

    def deny_writes(self, index: int, deny: bool = True) -> None:
        """Make set calls on one GPU fail with NO_PERMISSION (as NVML does without root)."""
        with self._cond:
            self._gpu(index).deny_writes = deny

    def write_count(self, index: int) -> int:
        with self._cond:
            return self._gpu(index).writes

    # ---- internals ----

    def _gpu(self, index: int) -> _SimGpu:
        if not 0 <= index < len(self._gpus):
            raise GpuError(GpuErrorCode.NOT_FOUND, f"no GPU with index {index}", index)
        return self._gpus[index]

    def _writable(self, index: int) -> _SimGpu:
        g = self._gpu(index)
        if g.lost:
            raise GpuError(GpuErrorCode.GPU_IS_LOST, "GPU has fallen off the bus", index)
        if g.deny_writes:
            raise GpuError(GpuErrorCode.NO_PERMISSION, "insufficient permissions", index)
        return g

    def _emit(self, event: GpuEvent) -> None:
        self._events.append(event)
        self.events_emitted += 1
        self._cond.notify_all()

    def _reading(self, index: int, g: _SimGpu) -> GpuReading:
        s, m = self.spec, self.model
        cap_ratio = g.limit_w / s.tdp_w
        power_clock = s.nominal_sm_clock_mhz * m.throughput(cap_ratio)
        clock = min(power_clock, float(s.max_sm_clock_mhz))
        power_bound = not (g.locked_mhz and g.locked_mhz < clock)
        if not power_bound:
            clock = float(g.locked_mhz)
        draw = g.limit_w if power_bound else s.tdp_w * (m.power_for(clock / s.nominal_sm_clock_mhz) or 1.0)
        reasons = THROTTLE_SW_POWER_CAP if power_bound else 0
        thermal_factor = THERMAL_SPEED if g.thermal else 1.0
        if g.thermal:
            reasons |= THROTTLE_SW_THERMAL | THROTTLE_HW_THERMAL
            clock *= THERMAL_SPEED
        temperature = THERMAL_TEMP_C if g.thermal else 35.0 + 45.0 * draw / s.tdp_w
        return GpuReading(
            index=index, power_draw_w=round(draw, 3), power_limit_w=g.limit_w,
            sm_clock_mhz=int(round(clock)), temperature_c=round(temperature, 1),
            throttle_reasons=reasons, ecc_dbe_volatile=g.dbe,
            nvlinks_total=NVLINKS_PER_GPU, nvlinks_down=0, locked_sm_clock_mhz=g.locked_mhz,
            relative_speed=g.slow_factor * thermal_factor,
            relative_throughput=clock / s.nominal_sm_clock_mhz * g.slow_factor,
        )
