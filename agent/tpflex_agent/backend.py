"""The hardware seam: :class:`GpuBackend` and the value types that cross it.

Units at this interface are watts, MHz and degrees Celsius (NVML's mW stay inside the
NVML backend). Two implementations: ``nvml.NvmlBackend`` and ``sim.SimulatedBackend``;
``tests/agent/test_backend_conformance.py`` runs one suite against both.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Protocol, runtime_checkable

# NVML clocks-event (throttle) reason bits (nvmlClocksEventReason*).
THROTTLE_GPU_IDLE = 0x1
THROTTLE_APP_CLOCKS = 0x2
THROTTLE_SW_POWER_CAP = 0x4
THROTTLE_HW_SLOWDOWN = 0x8
THROTTLE_SYNC_BOOST = 0x10
THROTTLE_SW_THERMAL = 0x20
THROTTLE_HW_THERMAL = 0x40
THROTTLE_HW_POWER_BRAKE = 0x80

THROTTLE_REASON_NAMES: dict[int, str] = {
    THROTTLE_GPU_IDLE: "gpu_idle",
    THROTTLE_APP_CLOCKS: "applications_clocks",
    THROTTLE_SW_POWER_CAP: "sw_power_cap",
    THROTTLE_HW_SLOWDOWN: "hw_slowdown",
    THROTTLE_SYNC_BOOST: "sync_boost",
    THROTTLE_SW_THERMAL: "sw_thermal",
    THROTTLE_HW_THERMAL: "hw_thermal",
    THROTTLE_HW_POWER_BRAKE: "hw_power_brake",
}


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """Static facts and constraints of one GPU."""

    index: int
    uuid: str
    name: str
    serial: str
    default_limit_w: float
    min_limit_w: float
    max_limit_w: float
    max_sm_clock_mhz: int


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One sample of a GPU's dynamic state."""

    index: int
    power_draw_w: float
    power_limit_w: float          # enforced limit
    sm_clock_mhz: int
    temperature_c: float
    throttle_reasons: int         # NVML clocksEventReasons bitmask
    ecc_sbe_volatile: int = 0
    ecc_dbe_volatile: int = 0
    retired_pages: int = 0
    remapped_rows_pending: bool = False
    remapped_rows_failed: bool = False
    nvlinks_total: int = 0
    nvlinks_down: int = 0
    locked_sm_clock_mhz: int = 0  # 0 = not locked (as set through this backend)
    relative_speed: float = 1.0   # speed vs a healthy GPU at the same cap (< 1: slow)
    relative_throughput: float = 1.0  # vs a healthy GPU at its default limit


class FabricState(IntEnum):
    """NVML's nvmlGpuFabricState_t: the GPU's registration with the NVLink fabric."""

    NOT_SUPPORTED = 0
    NOT_STARTED = 1
    IN_PROGRESS = 2
    COMPLETED = 3


@dataclass(frozen=True, slots=True)
class FabricInfo:
    """A GPU's place in a multi-node NVLink fabric (GB200 NVL72): GPUs with the same
    cluster UUID and clique id share one NVLink domain."""

    cluster_uuid: str  # canonical lowercase 8-4-4-4-12 form
    clique_id: int
    state: FabricState
    status: int = 0  # NVML return code of the registration (0 = success)

    @property
    def registered(self) -> bool:
        return self.state == FabricState.COMPLETED and self.status == 0


class GpuEventKind(StrEnum):
    XID = "xid"
    DOUBLE_BIT_ECC = "dbe"


@dataclass(frozen=True, slots=True)
class GpuEvent:
    index: int
    kind: GpuEventKind
    xid: int = 0  # the XID code for XID events (48 for a double-bit ECC error)
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ClockTarget:
    """What the agent wants on one GPU: a power limit and optionally locked SM clocks."""

    cap_w: float
    locked_sm_clock_mhz: int = 0


@runtime_checkable
class GpuBackend(Protocol):
    """Narrow interface to a node's GPUs. Every method may raise ``errors.GpuError``."""

    kind: str  # "nvml" or "sim"

    def devices(self) -> list[DeviceInfo]: ...

    def read(self, index: int) -> GpuReading: ...

    def fabric(self, index: int) -> FabricInfo | None:
        """The GPU's NVLink fabric registration; None on a GPU without a fabric (NVML's
        "not supported": an HGX node, a PCIe card)."""
        ...

    def set_power_limit(self, index: int, watts: float) -> float:
        """Set the power limit; returns the enforced limit read back (watts)."""
        ...

    def lock_sm_clocks(self, index: int, mhz: int) -> None: ...

    def reset_sm_clocks(self, index: int) -> None: ...

    def wait_events(self, timeout_s: float) -> list[GpuEvent]:
        """Block up to ``timeout_s`` for XID / double-bit-ECC events; [] on timeout."""
        ...

    def close(self) -> None: ...
