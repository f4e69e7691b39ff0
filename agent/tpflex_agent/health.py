"""GPU health as an explicit state machine (pure: no I/O, no clock).

States are ``types_pb2.GpuState``: HEALTHY, DEGRADED (usable but throttled, slow, links
down, rows pending remap), FAILED (lost, double-bit ECC, a fatal XID). FAILED is sticky:
it is left only when a *recovery* is observed — the hardware signal that made the GPU
fail (lost, DBE counter, failed row remap) was seen and has cleared (a GPU reset clears
volatile counters and brings a lost GPU back). A fatal XID that came with no such signal
keeps the GPU FAILED until the agent restarts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tpflex_proto import types_pb2

from .backend import (
    THROTTLE_HW_SLOWDOWN,
    THROTTLE_HW_THERMAL,
    THROTTLE_SW_THERMAL,
    GpuEvent,
    GpuReading,
)
from .errors import GpuError, GpuErrorCode

HEALTHY = types_pb2.GPU_HEALTHY
DEGRADED = types_pb2.GPU_DEGRADED
FAILED = types_pb2.GPU_FAILED

# XIDs after which the GPU must not be used until reset (NVIDIA's XID catalogue).
FATAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    62: "internal micro-controller halt",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}
DEGRADING_THROTTLE = THROTTLE_HW_SLOWDOWN | THROTTLE_SW_THERMAL | THROTTLE_HW_THERMAL
SLOW_SPEED = 0.9  # relative speed below which a GPU counts as degraded

# (from, to) moves that need an observed recovery; every other move is allowed.
_NEEDS_RECOVERY = {(FAILED, HEALTHY), (FAILED, DEGRADED)}


class IllegalTransition(ValueError):
    def __init__(self, index: int, frm: int, to: int) -> None:
        super().__init__(
            f"gpu {index}: illegal health transition {types_pb2.GpuState.Name(frm)} -> "
            f"{types_pb2.GpuState.Name(to)} without an observed recovery"
        )


@dataclass(frozen=True)
class GpuHealthState:
    index: int
    state: int = HEALTHY
    reason: str = ""
    xids: tuple[int, ...] = ()
    hard_signal: bool = False   # a lost/DBE signal was seen since the last recovery
    fatal_xid: bool = False
    reading: GpuReading | None = None


@dataclass(frozen=True)
class Observation:
    """What the monitor saw for one GPU: a reading or the error reading it, new events."""

    reading: GpuReading | None = None
    error: GpuError | None = None
    events: tuple[GpuEvent, ...] = field(default_factory=tuple)


def transition(index: int, frm: int, to: int, recovered: bool) -> int:
    if (frm, to) in _NEEDS_RECOVERY and not recovered:
        raise IllegalTransition(index, frm, to)
    return to


def _hard_failure(obs: Observation) -> str | None:
    if obs.error is not None and obs.error.code == GpuErrorCode.GPU_IS_LOST:
        return f"gpu lost: {obs.error}"
    r = obs.reading
    if r is not None and r.ecc_dbe_volatile > 0:
        return f"double-bit ECC errors: {r.ecc_dbe_volatile}"
    if r is not None and r.remapped_rows_failed:
        return "row remapping failed"
    return None


def _degradation(r: GpuReading | None) -> str | None:
    if r is None:
        return None
    reasons = []
    if r.throttle_reasons & DEGRADING_THROTTLE:
        reasons.append(f"thermal/hw throttling (reasons 0x{r.throttle_reasons:x})")
    if r.relative_speed < SLOW_SPEED:
        reasons.append(f"slow: relative speed {r.relative_speed:.2f}")
    if r.nvlinks_down:
        reasons.append(f"nvlink down: {r.nvlinks_down} of {r.nvlinks_total}")
    if r.remapped_rows_pending:
        reasons.append("row remapping pending (reset required)")
    return "; ".join(reasons) or None


def assess(prev: GpuHealthState, obs: Observation) -> GpuHealthState:
    """The next health of one GPU from its previous health and a new observation."""
    new_xids = tuple(e.xid for e in obs.events if e.xid)
    fatal_events = [x for x in new_xids if x in FATAL_XIDS]
    xids = prev.xids + new_xids
    fatal_xid = prev.fatal_xid or bool(fatal_events)
    reading = obs.reading if obs.reading is not None else prev.reading
    hard = _hard_failure(obs)
    if hard is not None:
        state, reason, hard_signal = FAILED, hard, True
        if obs.error is not None:
            reading = None  # a lost GPU has no current readings
        if fatal_xid:
            reason = f"{_xid_reason(xids)}; {hard}"
    elif obs.error is not None:  # unreadable for another reason: keep the state, say why
        return replace(prev, xids=xids, fatal_xid=fatal_xid,
                       reason=prev.reason or f"read failed: {obs.error}")
    elif prev.hard_signal:  # the hardware signal cleared: recovered
        return _settle(prev, GpuHealthState(prev.index, reading=reading), recovered=True)
    elif fatal_xid:
        state, reason, hard_signal = FAILED, _xid_reason(xids), False
    else:
        degraded = _degradation(reading)
        state, reason, hard_signal = (DEGRADED, degraded, False) if degraded else (HEALTHY, "", False)
    nxt = GpuHealthState(prev.index, state, reason, xids, hard_signal, fatal_xid, reading)
    return _settle(prev, nxt, recovered=False)


def _settle(prev: GpuHealthState, nxt: GpuHealthState, recovered: bool) -> GpuHealthState:
    if recovered:
        degraded = _degradation(nxt.reading)
        nxt = replace(nxt, state=DEGRADED if degraded else HEALTHY, reason=degraded or "recovered")
    transition(prev.index, prev.state, nxt.state, recovered)
    return nxt


def _xid_reason(xids: tuple[int, ...]) -> str:
    fatal = [x for x in xids if x in FATAL_XIDS]
    x = fatal[-1] if fatal else xids[-1]
    return f"xid {x}: {FATAL_XIDS.get(x, 'GPU error')}"


def to_proto(h: GpuHealthState, updated_at: float) -> types_pb2.GpuHealth:
    msg = types_pb2.GpuHealth(index=h.index, state=h.state, reason=h.reason, xids=list(h.xids),
                              updated_at=updated_at)
    r = h.reading
    if r is not None:
        msg.throttle_reasons = r.throttle_reasons
        msg.temperature_c = r.temperature_c
        msg.power_draw_w = r.power_draw_w
        msg.power_limit_w = r.power_limit_w
        msg.sm_clock_mhz = r.sm_clock_mhz
        msg.relative_speed = r.relative_speed
    return msg
