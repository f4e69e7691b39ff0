"""The flap-damping state machine (pure, synthetic clock): every transition, the hold-down
schedule, and the reconfiguration count for a flapping GPU."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tpflex_controller.damping import (
    TRANSITIONS,
    FlapDamper,
    IllegalTransition,
    Phase,
    Signal,
    step,
)

GPU = ("node-a", 3)


@pytest.mark.parametrize("phase,signal", list(itertools.product(Phase, Signal)))
def test_every_phase_signal_pair_is_either_in_the_table_or_illegal(phase, signal):
    if (phase, signal) in TRANSITIONS:
        assert step(phase, signal) is TRANSITIONS[(phase, signal)]
    else:
        assert signal is Signal.EXPIRE and phase is not Phase.HELD
        with pytest.raises(IllegalTransition, match="expire is not allowed"):
            step(phase, signal)


def test_failure_counts_at_once_recovery_waits_for_the_hold_down():
    d = FlapDamper(10.0)
    assert d.observe(GPU, True, 100.0) is True and d.phase(GPU) is Phase.DOWN
    assert d.observe(GPU, True, 101.0) is True  # repeated report: same episode
    assert d.observe(GPU, False, 102.0) is True and d.phase(GPU) is Phase.HELD
    assert d.next_release() == 112.0
    assert d.release_due(111.999) == []
    assert d.observe(GPU, False, 105.0) is True  # healthy reports do not shorten it
    assert d.release_due(112.0) == [GPU]
    assert d.phase(GPU) is Phase.UP and d.observe(GPU, False, 113.0) is False
    assert d.next_release() is None


def test_hold_down_doubles_per_recent_failure_and_is_capped():
    d = FlapDamper(1.0, max_factor=8, memory_factor=100)
    holds = []
    t = 0.0
    for _ in range(6):
        d.observe(GPU, True, t)
        d.observe(GPU, False, t + 0.1)
        holds.append(d.next_release() - (t + 0.1))
        t += 0.5  # fails again while held
    assert holds == pytest.approx([1, 2, 4, 8, 8, 8])


def test_old_failures_are_forgotten_and_the_track_dropped():
    d = FlapDamper(1.0, memory_factor=16)
    d.observe(GPU, True, 0.0)
    d.observe(GPU, False, 0.5)
    assert d.release_due(1.5) == [GPU]
    assert GPU in d.tracked()  # the failure is still recent
    d.observe(GPU, True, 20.0)  # 20 s later: the first failure is forgotten
    d.observe(GPU, False, 20.5)
    assert d.next_release() == pytest.approx(21.5)  # base again, not 2x
    d.release_due(21.5)
    assert d.observe(GPU, False, 40.0) is False
    assert d.tracked() == []  # bounded memory: only recent flappers are kept


def test_zero_hold_down_is_off():
    d = FlapDamper(0.0)
    assert d.observe(GPU, True, 0.0) is True
    assert d.observe(GPU, False, 0.0) is False
    assert d.tracked() == [] and d.next_release() is None


def test_bad_parameters_are_refused():
    for kw in ({"hold_down_s": -1}, {"hold_down_s": 1, "max_factor": 0.5}, {"hold_down_s": 1, "memory_factor": 0}):
        with pytest.raises(ValueError):
            FlapDamper(**kw)


def _effective_changes(d: FlapDamper, reports: list[tuple[float, bool]], end: float) -> int:
    """How often the planner-visible state of GPU flips (each flip = one re-plan)."""
    flips, last = 0, False
    for at, failed in reports:
        d.release_due(at)
        if d.phase(GPU) is Phase.UP and last:
            flips, last = flips + 1, False
        now = d.observe(GPU, failed, at)
        if now != last:
            flips, last = flips + 1, now
    d.release_due(end)
    if d.phase(GPU) is Phase.UP and last:
        flips += 1
    return flips


def test_a_flapping_gpu_costs_two_reconfigurations_not_two_per_flap():
    reports = []
    for i in range(50):  # 50 flaps, 1 s period
        reports += [(i * 1.0, True), (i * 1.0 + 0.5, False)]
    assert _effective_changes(FlapDamper(2.0), list(reports), end=200.0) == 2
    assert _effective_changes(FlapDamper(0.0), list(reports), end=200.0) == 100


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), st.booleans()), max_size=40), st.floats(0, 5))
def test_never_reports_healthy_while_reported_failed_and_always_releases(events, base):
    d = FlapDamper(base)
    t = 0.0
    for gap, failed in events:
        t += gap
        d.release_due(t)
        eff = d.observe(GPU, failed, t)
        assert eff or not failed  # safety: a failed GPU is never plannable
        if eff and not failed:
            assert d.phase(GPU) is Phase.HELD and d.next_release() <= t + 8 * base
    d.release_due(t + 8 * base)  # liveness: every hold-down ends by the cap
    assert d.phase(GPU) is not Phase.HELD


# ---- wired into the controller's view (pure: folds of etcd values, synthetic clock) ----


def _view(hold: float, clock):
    from tpflex_controller import synthetic
    from tpflex_controller.cache import ClusterView
    from tpflex_proto import codec, keys

    view = ClusterView()
    view.damper, view.damper_clock = FlapDamper(hold), clock
    rack = synthetic.rack("rack0", 2, 2)
    view.fold("put", keys.rack("rack0"), codec.encode(rack), 1)
    for n in rack.nodes:
        view.fold("put", keys.node(n), codec.encode(synthetic.node(n, "rack0", 2)), 2)
    view.fold("put", keys.job_spec("job1"), codec.encode(synthetic.job("job1", ["rack0"], 4)), 3)
    return view


def _health(view, failed: set[int], rev: int):
    from tpflex_controller import synthetic
    from tpflex_proto import codec, keys

    return view.fold("put", keys.health("rack0-n00"), codec.encode(synthetic.failed_health("rack0-n00", 2, failed, rev)), rev)


def test_view_holds_a_recovered_gpu_until_the_hold_down_ends():
    from tpflex_controller.planner.model import GpuStatus

    now = [100.0]
    view = _view(5.0, lambda: now[0])
    assert _health(view, {1}, 10) == [("job1", "gpu_failed")]
    now[0] = 101.0
    assert _health(view, set(), 11) == []  # reported healthy, still held: no re-plan
    assert view.gpu_status[("rack0-n00", 1)] is GpuStatus.FAILED
    now[0] = 105.9
    assert view.release_held() == []
    now[0] = 106.0
    assert view.release_held() == [("job1", "gpu_recovered")]
    assert ("rack0-n00", 1) not in view.gpu_status


def test_a_re_read_view_keeps_held_gpus_held():
    from tpflex_controller.cache import ClusterView
    from tpflex_controller.planner.model import GpuStatus
    from tpflex_proto import keys

    now = [0.0]
    view = _view(5.0, lambda: now[0])
    _health(view, {0}, 10)
    _health(view, set(), 11)
    fresh = ClusterView()  # what the reconciler builds from the informer's state: folded without the damper
    for key, value in ((keys.rack("rack0"), view.snap.racks["rack0"].SerializeToString()),
                       (keys.health("rack0-n00"), view.snap.health["rack0-n00"].SerializeToString())):
        fresh.fold("put", key, value, 12)
    assert ("rack0-n00", 0) not in fresh.gpu_status
    fresh.attach_damper(view.damper, lambda: now[0])
    assert fresh.gpu_status[("rack0-n00", 0)] is GpuStatus.FAILED


def test_a_replayed_older_event_does_not_move_the_view_back():
    """After a re-read at revision R, a lagging watch delivers events older than R."""
    from tpflex_controller.planner.model import GpuStatus

    view = _view(0.0, lambda: 0.0)
    _health(view, {1}, 20)  # what the re-read saw (newest)
    assert _health(view, set(), 15) == []  # an older write, replayed by the watch: ignored
    assert view.gpu_status[("rack0-n00", 1)] is GpuStatus.FAILED
    assert _health(view, set(), 21) == [("job1", "gpu_recovered")]  # newer writes still count


# ---- the damping as shared state (holds.py: stored holds, adopted by a new leader) ----


def test_adopted_holds_win_and_unnamed_held_gpus_are_released():
    from tpflex_controller.damping import Hold

    d = FlapDamper(10.0)
    other = ("node-b", 0)
    d.observe(other, True, 0.0)
    d.observe(other, False, 1.0)  # held here, but no stored hold names it: released
    d.observe(("node-c", 0), True, 0.0)  # down here: its health decides, kept
    adopted = d.adopt({GPU: Hold(Phase.HELD, 50.0, 3)}, 2.0)
    assert adopted == {GPU: Hold(Phase.HELD, 50.0)} and adopted[GPU].failures == 3
    assert d.phase(GPU) is Phase.HELD and d.phase(other) is Phase.UP
    assert d.phase(("node-c", 0)) is Phase.DOWN
    assert d.next_release() == 50.0 and d.release_due(50.0) == [GPU]
    assert d.hold_down(GPU, 51.0) == 40.0  # the 3 adopted failures still lengthen the next one
    assert FlapDamper(0.0).adopt({GPU: Hold(Phase.HELD, 50.0, 1)}, 0.0) == {}  # damping off


def test_a_stored_hold_converts_between_the_clocks():
    from tpflex_controller.damping import Hold
    from tpflex_controller.holds import changes, from_record, to_record

    held = Hold(Phase.HELD, 130.0, 2)
    rec = to_record(GPU, held, 100.0, 5000.0)  # monotonic 100 is wall 5000
    assert (rec.gpu.node, rec.gpu.index, rec.until, rec.failures) == ("node-a", 3, 5030.0, 2)
    assert "hold-down" in rec.reason
    assert from_record(rec, 7.0, 5010.0) == Hold(Phase.HELD, 27.0)  # another process's clocks
    down = to_record(GPU, Hold(Phase.DOWN, 0.0, 1), 100.0, 5000.0)
    assert down.until == 0 and from_record(down, 1.0, 1.0) == Hold(Phase.DOWN)
    b = ("node-b", 1)
    puts, deletes = changes({GPU: held, b: Hold(Phase.DOWN)}, {GPU: held, ("x", 0): Hold(Phase.DOWN)})
    assert puts == {b: Hold(Phase.DOWN)} and deletes == [("x", 0)]


def test_the_leader_stores_each_hold_and_deletes_it_when_the_hold_down_ends(etcd_server, etcd):
    """A real etcd and an in-process controller: fail, recover, release."""
    from tpflex_proto import keys

    from tests.controller.controller_harness import controller_on_job, fail_gpu

    gpu = ("rack0-n00", 1)
    key = keys.gpu_hold(*gpu)
    with controller_on_job(etcd_server, etcd, flap_hold_down_s=1.0) as (_racks, watcher, _ctl):
        watcher.wait_generation(1, timeout=20)
        fail_gpu(etcd, gpu[0], 2, {gpu[1]}, seq=1)
        watcher.wait_generation(2, timeout=20)
        _wait_key(etcd, key, lambda rec: rec is not None and rec.until == 0)
        fail_gpu(etcd, gpu[0], 2, set(), seq=2)
        rec = _wait_key(etcd, key, lambda rec: rec is not None and rec.until > 0)
        assert rec.failures == 1
        back = watcher.wait_generation(3, timeout=20)  # released: planned again
        assert gpu in {(g.node, g.index) for r in back.replicas for st in r.stages for g in st.gpus}
        assert back.created_at >= rec.until - 0.05
        _wait_key(etcd, key, lambda rec: rec is None)  # bounded: gone with the hold-down


def _wait_key(etcd, key, cond):
    from tpflex_proto import codec, types_pb2

    from tests.support.wait import wait_until

    def read():
        kv = etcd.get(key)
        rec = codec.decode(types_pb2.GpuHold, kv.value) if kv is not None else None
        return (rec,) if cond(rec) else None

    return wait_until(read, 20, f"hold key {key}")[0]
