"""The NVML backend over ``nvidia-ml-py`` (``pynvml``).

NVML speaks mW and MHz; this module converts to watts at the interface. Every
``pynvml.NVMLError`` becomes a :class:`~tpflex_agent.errors.GpuError` with a code, raised
``from`` the NVML error so the cause is kept.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from ctypes import byref
from typing import TypeVar

import pynvml

from .backend import DeviceInfo, FabricInfo, FabricState, GpuEvent, GpuEventKind, GpuReading
from .errors import BackendUnavailable, GpuError, GpuErrorCode

log = logging.getLogger(__name__)
T = TypeVar("T")

_CODES: dict[int, GpuErrorCode] = {
    pynvml.NVML_ERROR_NO_PERMISSION: GpuErrorCode.NO_PERMISSION,
    pynvml.NVML_ERROR_NOT_SUPPORTED: GpuErrorCode.NOT_SUPPORTED,
    pynvml.NVML_ERROR_GPU_IS_LOST: GpuErrorCode.GPU_IS_LOST,
    pynvml.NVML_ERROR_INVALID_ARGUMENT: GpuErrorCode.INVALID_ARGUMENT,
    pynvml.NVML_ERROR_NOT_FOUND: GpuErrorCode.NOT_FOUND,
    pynvml.NVML_ERROR_GPU_NOT_FOUND: GpuErrorCode.NOT_FOUND,
    pynvml.NVML_ERROR_TIMEOUT: GpuErrorCode.TIMEOUT,
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: GpuErrorCode.DRIVER_NOT_LOADED,
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: GpuErrorCode.LIBRARY_NOT_FOUND,
    pynvml.NVML_ERROR_RESET_REQUIRED: GpuErrorCode.RESET_REQUIRED,
}
_EVENT_TYPES = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
_DBE_XID = 48


def gpu_error(exc: pynvml.NVMLError, what: str, index: int | None = None) -> GpuError:
    code = _CODES.get(exc.value, GpuErrorCode.UNKNOWN)
    return GpuError(code, f"{what}: {exc} (nvml code {exc.value})", index)


def _call(what: str, index: int | None, fn: Callable[..., T], *args) -> T:
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        raise gpu_error(exc, what, index) from exc


def _optional(what: str, index: int, default: T, fn: Callable[..., T], *args) -> T:
    """A query some GPUs do not support: NOT_SUPPORTED gives ``default``; others raise."""
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        if exc.value == pynvml.NVML_ERROR_NOT_SUPPORTED:
            return default
        raise gpu_error(exc, what, index) from exc


class NvmlBackend:
    kind = "nvml"

    def __init__(self) -> None:
        """Initialise NVML; :class:`BackendUnavailable` when there is no driver/library."""
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            if exc.value in (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED):
                raise BackendUnavailable(
                    _CODES[exc.value], f"no NVIDIA driver found; use --backend sim ({exc})"
                ) from exc
            raise gpu_error(exc, "nvmlInit") from exc
        self._lock = threading.Lock()
        self._locked: dict[int, int] = {}
        count = _call("nvmlDeviceGetCount", None, pynvml.nvmlDeviceGetCount)
        self._handles = [
            _call("nvmlDeviceGetHandleByIndex", i, pynvml.nvmlDeviceGetHandleByIndex, i)
            for i in range(count)
        ]
        self._devices = [self._describe(i) for i in range(count)]
        self._events = _call("nvmlEventSetCreate", None, pynvml.nvmlEventSetCreate)
        for i, h in enumerate(self._handles):
            try:
                pynvml.nvmlDeviceRegisterEvents(h, _EVENT_TYPES, self._events)
            except pynvml.NVMLError as exc:
                log.warning("nvml events not registered gpu=%d error=%s", i, exc)

    def _handle(self, index: int):
        if not 0 <= index < len(self._handles):
            raise GpuError(GpuErrorCode.NOT_FOUND, f"no GPU with index {index}", index)
        return self._handles[index]

    def _describe(self, i: int) -> DeviceInfo:
        """The GPU's facts; for a GPU lost at start-up (fallen off the bus), a stand-in
        with an empty UUID and a zero limit range, so the agent still starts: the lost GPU
        is read and reported as a GPU lost while running is (FAILED, unreadable), and the
        others are capped. Its facts are read again at the next start."""
        try:
            return self._describe_device(i)
        except GpuError as exc:
            if exc.code != GpuErrorCode.GPU_IS_LOST:
                raise
            log.warning("gpu lost at start-up: left undescribed gpu=%d error=%s", i, exc)
            return DeviceInfo(index=i, uuid="", name="", serial="", default_limit_w=0.0,
                              min_limit_w=0.0, max_limit_w=0.0, max_sm_clock_mhz=0)

    def _describe_device(self, i: int) -> DeviceInfo:
        h = self._handles[i]
        lo, hi = _call("limit constraints", i, pynvml.nvmlDeviceGetPowerManagementLimitConstraints, h)
        return DeviceInfo(
            index=i,
            uuid=_call("uuid", i, pynvml.nvmlDeviceGetUUID, h),
            name=_call("name", i, pynvml.nvmlDeviceGetName, h),
            serial=_optional("serial", i, "", pynvml.nvmlDeviceGetSerial, h),
            default_limit_w=_call("default limit", i, pynvml.nvmlDeviceGetPowerManagementDefaultLimit, h) / 1000.0,
            min_limit_w=lo / 1000.0,
            max_limit_w=hi / 1000.0,
            max_sm_clock_mhz=_call("max SM clock", i, pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_SM),
        )

    def devices(self) -> list[DeviceInfo]:
        return list(self._devices)

    def read(self, index: int) -> GpuReading:
        h = self._handle(index)
        corr_unc_pending_failed = _optional("remapped rows", index, (0, 0, 0, 0), pynvml.nvmlDeviceGetRemappedRows, h)
        total, down = self._nvlinks(index, h)
        return GpuReading(
            index=index,
            power_draw_w=_call("power usage", index, pynvml.nvmlDeviceGetPowerUsage, h) / 1000.0,
            power_limit_w=_call("enforced limit", index, pynvml.nvmlDeviceGetEnforcedPowerLimit, h) / 1000.0,
            sm_clock_mhz=_call("SM clock", index, pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM),
            temperature_c=float(_call("temperature", index, pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU)),
            throttle_reasons=_optional("clocks event reasons", index, 0, pynvml.nvmlDeviceGetCurrentClocksEventReasons, h),
            ecc_sbe_volatile=_optional("ecc sbe", index, 0, pynvml.nvmlDeviceGetTotalEccErrors, h,
                                       pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC),
            ecc_dbe_volatile=_optional("ecc dbe", index, 0, pynvml.nvmlDeviceGetTotalEccErrors, h,
                                       pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC),
            retired_pages=len(_optional("retired pages", index, [], pynvml.nvmlDeviceGetRetiredPages, h,
                                        pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)),
            remapped_rows_pending=bool(corr_unc_pending_failed[2]),
            remapped_rows_failed=bool(corr_unc_pending_failed[3]),
            nvlinks_total=total,
            nvlinks_down=down,
            locked_sm_clock_mhz=self._locked.get(index, 0),
        )

    def _nvlinks(self, index: int, h) -> tuple[int, int]:
        total = down = 0
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                active = pynvml.nvmlDeviceGetNvLinkState(h, link)
            except pynvml.NVMLError as exc:
                if exc.value in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                    break
                raise gpu_error(exc, "nvlink state", index) from exc
            total += 1
            down += 0 if active else 1
        return total, down

    def fabric(self, index: int) -> FabricInfo | None:
        """nvmlDeviceGetGpuFabricInfoV (the versioned call), or the older
        nvmlDeviceGetGpuFabricInfo on drivers without it."""
        h = self._handle(index)
        try:
            info = pynvml.c_nvmlGpuFabricInfoV_t()
            try:
                pynvml.nvmlDeviceGetGpuFabricInfoV(h, byref(info))
            except pynvml.NVMLError as exc:
                if exc.value != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    raise
                info = pynvml.c_nvmlGpuFabricInfo_t()
                pynvml.nvmlDeviceGetGpuFabricInfo(h, byref(info))
        except pynvml.NVMLError as exc:
            if exc.value in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                return None
            raise gpu_error(exc, "fabric info", index) from exc
        if info.state == FabricState.NOT_SUPPORTED:
            return None
        return FabricInfo(cluster_uuid=fabric_uuid(bytes(info.clusterUuid)), clique_id=int(info.cliqueId),
                          state=FabricState(int(info.state)), status=int(info.status))

    def set_power_limit(self, index: int, watts: float) -> float:
        h = self._handle(index)
        _call("set power limit", index, pynvml.nvmlDeviceSetPowerManagementLimit, h, int(round(watts * 1000)))
        return _call("enforced limit", index, pynvml.nvmlDeviceGetEnforcedPowerLimit, h) / 1000.0

    def lock_sm_clocks(self, index: int, mhz: int) -> None:
        h = self._handle(index)
        _call("lock GPU clocks", index, pynvml.nvmlDeviceSetGpuLockedClocks, h, int(mhz), int(mhz))
        with self._lock:
            self._locked[index] = int(mhz)

    def reset_sm_clocks(self, index: int) -> None:
        h = self._handle(index)
        _call("reset GPU clocks", index, pynvml.nvmlDeviceResetGpuLockedClocks, h)
        with self._lock:
            self._locked.pop(index, None)

    def wait_events(self, timeout_s: float) -> list[GpuEvent]:
        out: list[GpuEvent] = []
        timeout_ms = max(0, int(timeout_s * 1000))
        while True:
            try:
                data = pynvml.nvmlEventSetWait(self._events, timeout_ms)
            except pynvml.NVMLError as exc:
                if exc.value == pynvml.NVML_ERROR_TIMEOUT:
                    return out
                raise gpu_error(exc, "nvmlEventSetWait") from exc
            out.append(self._event(data))
            timeout_ms = 0  # drain what is already queued, then return

    def _event(self, data) -> GpuEvent:
        index = next(
            (i for i, h in enumerate(self._handles)
             if _addr(h) == _addr(data.device)), -1,
        )
        if data.eventType == pynvml.nvmlEventTypeDoubleBitEccError:
            return GpuEvent(index, GpuEventKind.DOUBLE_BIT_ECC, _DBE_XID, "double-bit ECC error")
        return GpuEvent(index, GpuEventKind.XID, int(data.eventData), f"xid {int(data.eventData)}")

    def close(self) -> None:
        try:
            pynvml.nvmlEventSetFree(self._events)
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.warning("nvml shutdown failed error=%s", exc)


def fabric_uuid(raw: bytes) -> str:
    """NVML's 16-byte cluster UUID in the canonical 8-4-4-4-12 lowercase form."""
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _addr(handle) -> int:
    import ctypes

    return ctypes.cast(handle, ctypes.c_void_p).value or 0
