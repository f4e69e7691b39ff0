"""The simulated GPU's physics follows the shared power model."""

from __future__ import annotations

import pytest
from tpflex_agent.sim import SimulatedBackend
from tpflex_proto.powermodel import DEFAULT_POWER_MODEL


@pytest.mark.parametrize("ratio", [0.6, 0.8, 1.0, 1.1, 1.2, 1.3])
def test_cap_to_throughput_follows_the_power_model(ratio):
    b = SimulatedBackend(1)
    tdp = b.devices()[0].default_limit_w
    b.set_power_limit(0, tdp * ratio)
    r = b.read(0)
    assert r.relative_throughput == pytest.approx(DEFAULT_POWER_MODEL.throughput(ratio), abs=1e-3)
    assert r.sm_clock_mhz == pytest.approx(b.spec.nominal_sm_clock_mhz * DEFAULT_POWER_MODEL.throughput(ratio), abs=1)
    assert r.power_draw_w == pytest.approx(tdp * ratio)


def test_max_limit_is_the_model_boost_ceiling():
    b = SimulatedBackend(1)
    d = b.devices()[0]
    assert d.max_limit_w == pytest.approx(d.default_limit_w * DEFAULT_POWER_MODEL.max_power_ratio)


def test_locked_clock_lowers_clock_and_draw():
    b = SimulatedBackend(1)
    b.lock_sm_clocks(0, 850)
    r = b.read(0)
    assert r.sm_clock_mhz == 850 and r.relative_throughput == pytest.approx(0.5)
    assert r.power_draw_w == pytest.approx(700.0 * DEFAULT_POWER_MODEL.power_for(0.5))


def test_slow_and_thermal_faults_and_recovery():
    b = SimulatedBackend(2)
    b.inject_fault(0, "slow", 0.5)
    b.inject_fault(1, "thermal")
    assert b.read(0).relative_speed == 0.5 and b.read(0).relative_throughput == pytest.approx(0.5)
    assert b.read(1).relative_speed == pytest.approx(0.7) and b.read(1).temperature_c >= 90
    b.inject_fault(0, "recover")
    b.inject_fault(1, "recover")
    assert b.read(0).relative_speed == 1.0 and b.read(1).relative_speed == 1.0
