"""Power plan validation and resolution (pure)."""

from __future__ import annotations

import math

import pytest
from tpflex_agent.backend import ClockTarget, DeviceInfo
from tpflex_agent.errors import AgentError, AgentErrorCode
from tpflex_agent.plan import AppliedPlan, CapRequest, apply_order, resolve_plan

DEVS = [DeviceInfo(i, f"GPU-{i}", "g", f"s{i}", 700.0, 200.0, 910.0, 1980) for i in range(4)]


def resolve(gen, caps, current=None):
    return resolve_plan("n1", gen, caps, DEVS, current)


def test_unlisted_gpus_go_back_to_default():
    r = resolve(3, [CapRequest("n1", 1, 800.0, 1500), CapRequest("", 2, 650.0)])
    assert r.targets == {0: ClockTarget(700.0), 1: ClockTarget(800.0, 1500),
                         2: ClockTarget(650.0), 3: ClockTarget(700.0)}
    assert not r.already_applied


@pytest.mark.parametrize("cap,words", [
    (CapRequest("n1", 0, 950.0), "outside the device's range [200, 910] W"),
    (CapRequest("n1", 0, 150.0), "outside the device's range"),
    (CapRequest("n1", 0, 199.9999), "cap 199.9999 W outside"),  # the cap as sent, not rounded to 200
    (CapRequest("n1", 9, 700.0), "unknown GPU index 9 (node n1 has indices 0..3)"),
    (CapRequest("n1", 0, math.nan), "not a finite number"),
    (CapRequest("n1", 0, math.inf), "not a finite number"),
    (CapRequest("n2", 0, 700.0), "sent to node n1"),
    (CapRequest("n1", 0, 700.0, 5000), "locked SM clock 5000 MHz"),
])
def test_bad_values_are_invalid_argument(cap, words):
    with pytest.raises(AgentError) as err:
        resolve(1, [CapRequest("n1", 1, 800.0), cap])
    assert err.value.code == AgentErrorCode.INVALID_ARGUMENT and words in err.value.message


def test_duplicate_gpu_and_generation_zero_are_invalid():
    with pytest.raises(AgentError, match="appears twice"):
        resolve(1, [CapRequest("n1", 1, 800.0), CapRequest("n1", 1, 700.0)])
    with pytest.raises(AgentError, match="generation must be >= 1"):
        resolve(0, [])


def test_generations():
    applied = AppliedPlan(5, resolve(5, [CapRequest("n1", 0, 800.0)]).targets, complete=True)
    with pytest.raises(AgentError) as err:
        resolve(4, [], applied)
    assert err.value.code == AgentErrorCode.STALE_GENERATION and "stale generation 4" in err.value.message
    assert resolve(5, [CapRequest("n1", 0, 800.0)], applied).already_applied
    with pytest.raises(AgentError) as err:
        resolve(5, [CapRequest("n1", 0, 810.0)], applied)
    assert err.value.code == AgentErrorCode.GENERATION_CONFLICT
    partial = AppliedPlan(5, applied.targets, complete=False)
    assert not resolve(5, [CapRequest("n1", 0, 800.0)], partial).already_applied  # retried
    assert not resolve(6, [], applied).already_applied


def test_decreases_are_applied_before_increases():
    targets = {0: ClockTarget(900.0), 1: ClockTarget(500.0), 2: ClockTarget(700.0), 3: ClockTarget(600.0)}
    current = {0: 700.0, 1: 700.0, 2: 700.0, 3: 700.0}
    order = apply_order(targets, current)
    assert order.index(0) == 3 and set(order[:3]) == {1, 2, 3}
