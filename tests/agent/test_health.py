"""The GPU health state machine (pure)."""

from __future__ import annotations

import pytest
from tpflex_agent.backend import (
    THROTTLE_HW_THERMAL,
    THROTTLE_SW_POWER_CAP,
    GpuEvent,
    GpuEventKind,
    GpuReading,
)
from tpflex_agent.errors import GpuError, GpuErrorCode
from tpflex_agent.health import (
    DEGRADED,
    FAILED,
    HEALTHY,
    GpuHealthState,
    IllegalTransition,
    Observation,
    assess,
    transition,
)


def reading(**kw) -> GpuReading:
    base = dict(index=0, power_draw_w=690.0, power_limit_w=700.0, sm_clock_mhz=1700,
                temperature_c=60.0, throttle_reasons=THROTTLE_SW_POWER_CAP, nvlinks_total=18)
    return GpuReading(**{**base, **kw})


LOST = Observation(error=GpuError(GpuErrorCode.GPU_IS_LOST, "lost", 0))
XID79 = GpuEvent(0, GpuEventKind.XID, 79)


def test_power_cap_throttling_is_healthy():
    h = assess(GpuHealthState(0), Observation(reading()))
    assert (h.state, h.reason) == (HEALTHY, "")


@pytest.mark.parametrize("kw,words", [
    (dict(throttle_reasons=THROTTLE_HW_THERMAL, temperature_c=93), "thermal"),
    (dict(relative_speed=0.5), "slow"),
    (dict(nvlinks_down=2), "nvlink down: 2 of 18"),
    (dict(remapped_rows_pending=True), "remapping pending"),
])
def test_degradations(kw, words):
    h = assess(GpuHealthState(0), Observation(reading(**kw)))
    assert h.state == DEGRADED and words in h.reason
    assert assess(h, Observation(reading())).state == HEALTHY


def test_xid79_with_lost_gpu_fails_and_recovers_when_readable_again():
    h = assess(GpuHealthState(0), Observation(events=(XID79,), error=LOST.error))
    assert h.state == FAILED and h.xids == (79,) and "xid 79" in h.reason and h.reading is None
    h = assess(h, LOST)
    assert h.state == FAILED
    h = assess(h, Observation(reading()))
    assert (h.state, h.reason, h.xids) == (HEALTHY, "recovered", ())


def test_dbe_counter_fails_until_cleared():
    h = assess(GpuHealthState(0), Observation(reading(ecc_dbe_volatile=1),
                                              events=(GpuEvent(0, GpuEventKind.DOUBLE_BIT_ECC, 48),)))
    assert h.state == FAILED and "double-bit ECC" in h.reason
    assert assess(h, Observation(reading(ecc_dbe_volatile=1))).state == FAILED
    assert assess(h, Observation(reading())).state == HEALTHY


def test_fatal_xid_without_hardware_signal_is_sticky():
    h = assess(GpuHealthState(0), Observation(reading(), events=(GpuEvent(0, GpuEventKind.XID, 94),)))
    assert h.state == FAILED and "xid 94" in h.reason
    for _ in range(3):
        h = assess(h, Observation(reading()))
    assert h.state == FAILED


def test_non_fatal_xid_is_recorded_without_failing():
    h = assess(GpuHealthState(0), Observation(reading(), events=(GpuEvent(0, GpuEventKind.XID, 13),)))
    assert h.state == HEALTHY and h.xids == (13,)


def test_unreadable_for_another_reason_keeps_the_state():
    err = GpuError(GpuErrorCode.UNKNOWN, "driver hiccup", 0)
    h = assess(GpuHealthState(0, state=DEGRADED, reason="slow"), Observation(error=err))
    assert h.state == DEGRADED


def test_transition_table_refuses_leaving_failed_without_recovery():
    with pytest.raises(IllegalTransition, match="GPU_FAILED -> GPU_HEALTHY"):
        transition(0, FAILED, HEALTHY, recovered=False)
    assert transition(0, FAILED, HEALTHY, recovered=True) == HEALTHY
    assert transition(0, HEALTHY, FAILED, recovered=False) == FAILED
    assert transition(0, DEGRADED, HEALTHY, recovered=False) == HEALTHY
