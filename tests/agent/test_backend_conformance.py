"""One conformance suite for every GpuBackend.

In the main test run the suite runs against the simulated backend. The NVML backend must
load the fake libnvidia-ml.so.1 through LD_LIBRARY_PATH, which only works in a process
started with it: test_nvml_subrun.py runs this same module in such a subprocess with
TPFLEX_FAKE_NVML_SUBRUN=1, where the parameter is "nvml" instead.
"""

from __future__ import annotations

import os
import time

import pytest
from tpflex_agent.backend import (
    THROTTLE_HW_THERMAL,
    THROTTLE_SW_THERMAL,
    FabricInfo,
    FabricState,
    GpuBackend,
    GpuEventKind,
)
from tpflex_agent.errors import GpuError, GpuErrorCode

SUBRUN = os.environ.get("TPFLEX_FAKE_NVML_SUBRUN") == "1"


class SimHarness:
    kind = "sim"

    def __init__(self, tmp_path) -> None:
        from tpflex_agent.sim import SimulatedBackend

        self.backend = SimulatedBackend(2)

    def fall_off_bus(self, i: int) -> None:
        self.backend.inject_fault(i, "xid79")

    def double_bit_ecc(self, i: int) -> None:
        self.backend.inject_fault(i, "xid48")

    def thermal(self, i: int) -> None:
        self.backend.inject_fault(i, "thermal")

    def deny_writes(self, i: int) -> None:
        self.backend.deny_writes(i)

    def recover(self, i: int) -> None:
        self.backend.inject_fault(i, "recover")

    def fabric(self, cluster_uuid: str, clique: int, state: FabricState) -> None:
        self.backend.set_fabric(FabricInfo(cluster_uuid, clique, state))

    def older_driver(self) -> None:
        """No versioned fabric call (NVML only; the simulated GPUs have no driver)."""


class NvmlHarness:
    kind = "nvml"

    def __init__(self, tmp_path) -> None:
        from tests.agent.support import FakeNvml

        self.state = FakeNvml(tmp_path / "nvml.state", count=2)
        os.environ["FAKE_NVML_STATE"] = str(self.state.path)
        from tpflex_agent.nvml import NvmlBackend

        self.backend = NvmlBackend()

    def fall_off_bus(self, i: int) -> None:
        self.state.xid(i, 79, lost=1)

    def double_bit_ecc(self, i: int) -> None:
        self.state.dbe(i)

    def thermal(self, i: int) -> None:
        self.state.set(i, temp=93, throttle=THROTTLE_SW_THERMAL | THROTTLE_HW_THERMAL)

    def deny_writes(self, i: int) -> None:
        self.state.set(i, deny_set=1)

    def recover(self, i: int) -> None:
        self.state.set(i, lost=0, ecc_dbe=0, temp=55, throttle=4)

    def fabric(self, cluster_uuid: str, clique: int, state: FabricState) -> None:
        self.state.fabric(cluster_uuid, clique, int(state))

    def older_driver(self) -> None:
        for i in range(self.state.count):
            self.state.gpus[i]["fabric_legacy"] = 1
        self.state.write()


@pytest.fixture(params=["nvml"] if SUBRUN else ["sim"])
def harness(request, tmp_path):
    h = (NvmlHarness if request.param == "nvml" else SimHarness)(tmp_path)
    try:
        yield h
    finally:
        h.backend.close()


def test_implements_the_protocol(harness):
    assert isinstance(harness.backend, GpuBackend)
    assert harness.backend.kind == harness.kind


def test_enumerates_devices_with_constraints_in_watts(harness):
    devs = harness.backend.devices()
    assert [d.index for d in devs] == [0, 1]
    assert len({d.uuid for d in devs}) == 2 and all(d.uuid.startswith("GPU-") for d in devs)
    for d in devs:
        assert d.name and d.serial
        assert 50 <= d.min_limit_w <= d.default_limit_w <= d.max_limit_w <= 2000  # watts, not mW
        assert 500 <= d.max_sm_clock_mhz <= 5000


def test_reading_is_consistent_with_the_limits(harness):
    d = harness.backend.devices()[0]
    r = harness.backend.read(0)
    assert r.power_limit_w == pytest.approx(d.default_limit_w)
    assert 0 < r.power_draw_w <= r.power_limit_w + 1e-6
    assert 0 < r.sm_clock_mhz <= d.max_sm_clock_mhz
    assert 10 <= r.temperature_c <= 120
    assert r.ecc_dbe_volatile == 0 and not r.remapped_rows_failed
    assert r.nvlinks_total > 0 and r.nvlinks_down == 0
    assert r.throttle_reasons & (THROTTLE_SW_THERMAL | THROTTLE_HW_THERMAL) == 0


def test_set_power_limit_reads_back(harness):
    d = harness.backend.devices()[1]
    target = round((d.min_limit_w + d.default_limit_w) / 2)
    assert harness.backend.set_power_limit(1, target) == pytest.approx(target)
    assert harness.backend.read(1).power_limit_w == pytest.approx(target)
    assert harness.backend.read(0).power_limit_w == pytest.approx(d.default_limit_w)


def test_out_of_range_limit_is_refused_and_changes_nothing(harness):
    d = harness.backend.devices()[0]
    with pytest.raises(GpuError) as err:
        harness.backend.set_power_limit(0, d.max_limit_w + 50)
    assert err.value.code == GpuErrorCode.INVALID_ARGUMENT and err.value.index == 0
    assert harness.backend.read(0).power_limit_w == pytest.approx(d.default_limit_w)


def test_no_permission_on_set_is_a_typed_error_with_its_cause(harness):
    harness.deny_writes(0)
    d = harness.backend.devices()[0]
    with pytest.raises(GpuError) as err:
        harness.backend.set_power_limit(0, d.min_limit_w)
    assert err.value.code == GpuErrorCode.NO_PERMISSION
    with pytest.raises(GpuError) as err2:
        harness.backend.lock_sm_clocks(0, 1500)
    assert err2.value.code == GpuErrorCode.NO_PERMISSION
    if harness.kind == "nvml":
        import pynvml

        assert isinstance(err.value.__cause__, pynvml.NVMLError_NoPermission)
    assert harness.backend.read(0).power_limit_w == pytest.approx(d.default_limit_w)


def test_lock_and_reset_sm_clocks(harness):
    harness.backend.lock_sm_clocks(0, 1200)
    r = harness.backend.read(0)
    assert r.locked_sm_clock_mhz == 1200 and r.sm_clock_mhz <= 1200
    harness.backend.reset_sm_clocks(0)
    r = harness.backend.read(0)
    assert r.locked_sm_clock_mhz == 0 and r.sm_clock_mhz > 1200


def test_unknown_index_is_a_typed_error(harness):
    with pytest.raises(GpuError) as err:
        harness.backend.read(7)
    assert err.value.code == GpuErrorCode.NOT_FOUND


def test_wait_events_times_out_empty(harness):
    t0 = time.monotonic()
    assert harness.backend.wait_events(0.05) == []
    assert time.monotonic() - t0 < 2.0


def test_xid79_is_delivered_and_the_gpu_is_lost(harness):
    harness.fall_off_bus(1)
    events = harness.backend.wait_events(2.0)
    assert [(e.index, e.kind, e.xid) for e in events] == [(1, GpuEventKind.XID, 79)]
    with pytest.raises(GpuError) as err:
        harness.backend.read(1)
    assert err.value.code == GpuErrorCode.GPU_IS_LOST
    with pytest.raises(GpuError) as err2:
        harness.backend.set_power_limit(1, harness.backend.devices()[1].default_limit_w)
    assert err2.value.code == GpuErrorCode.GPU_IS_LOST
    assert harness.backend.read(0).power_limit_w > 0  # the other GPU is unaffected
    harness.recover(1)
    assert harness.backend.read(1).power_limit_w > 0


def test_double_bit_ecc_event_and_counter(harness):
    harness.double_bit_ecc(0)
    events = harness.backend.wait_events(2.0)
    assert [(e.index, e.kind, e.xid) for e in events] == [(0, GpuEventKind.DOUBLE_BIT_ECC, 48)]
    assert harness.backend.read(0).ecc_dbe_volatile >= 1


def test_thermal_throttling_shows_in_reasons(harness):
    harness.thermal(0)
    r = harness.backend.read(0)
    assert r.throttle_reasons & (THROTTLE_SW_THERMAL | THROTTLE_HW_THERMAL)
    assert r.temperature_c >= 85


CLUSTER = "2f1e9c3a-7b4d-4e8f-9a0b-1c2d3e4f5a6b"


def test_a_gpu_without_an_nvlink_fabric_reports_none(harness):
    assert harness.backend.fabric(0) is None and harness.backend.fabric(1) is None


def test_fabric_cluster_and_clique_of_registered_gpus(harness):
    harness.fabric(CLUSTER, 7, FabricState.COMPLETED)
    for i in (0, 1):
        info = harness.backend.fabric(i)
        assert info == FabricInfo(CLUSTER, 7, FabricState.COMPLETED, 0) and info.registered


def test_fabric_registration_in_progress_is_not_registered(harness):
    harness.fabric(CLUSTER, 7, FabricState.IN_PROGRESS)
    info = harness.backend.fabric(0)
    assert info is not None and info.state == FabricState.IN_PROGRESS and not info.registered


def test_fabric_of_a_lost_gpu_is_a_typed_error(harness):
    harness.fabric(CLUSTER, 1, FabricState.COMPLETED)
    harness.fall_off_bus(1)
    with pytest.raises(GpuError) as err:
        harness.backend.fabric(1)
    assert err.value.code == GpuErrorCode.GPU_IS_LOST
    assert harness.backend.fabric(0).clique_id == 1


def test_fabric_on_a_driver_without_the_versioned_call(harness):
    harness.fabric(CLUSTER, 3, FabricState.COMPLETED)
    harness.older_driver()
    assert harness.backend.fabric(1) == FabricInfo(CLUSTER, 3, FabricState.COMPLETED, 0)
