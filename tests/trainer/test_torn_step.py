"""A torn step (a rank dies after some members applied the step's optimizer update and
before others) is recovered without a checkpoint: the members ahead undo their update and
the step is replayed, ending with the weights and Adam moments of an uninterrupted run.
Real gloo processes; the runtime's test hook tears the step deterministically."""

from __future__ import annotations

import pytest
import torch
from tpflex_trainer.ntp.layout import Member
from tpflex_trainer.ntp.torn import FaultHook, InjectedFault, rollback_step

from tests.support.ports import free_port
from tests.trainer.harness import run_workers
from tests.trainer.scenarios import Change, Scenario, run_scenario
from tests.trainer.test_parity import CFG, assert_parity, members_of, reference_full, rp

START = (rp(0, range(2)), rp(1, range(2)))
DEGRADED = (rp(0, (1,)), rp(1, range(2)))
DEAD, TORN_AT, STEPS = Member(0, 0), 3, 6


def _final_states(results: dict) -> dict:
    """(kind, parameter, unit) -> rows; every copy of a unit must be identical."""
    out: dict = {}
    for res in results.values():
        for key, array in res["states"].items():
            rows = torch.from_numpy(array)
            if key in out:
                assert torch.equal(out[key], rows), f"two copies of {key} differ"
            out[key] = rows
    return out


def _rel_l2(a: dict, b: dict, kind: str) -> float:
    keys = sorted(k for k in a if k[0] == kind)
    x = torch.cat([a[k].reshape(-1) for k in keys])
    y = torch.cat([b[k].reshape(-1) for k in keys])
    return float((x - y).norm() / y.norm())


@pytest.mark.slow
def test_torn_step_is_replayed_without_a_checkpoint():
    # the dead member's newest copy is gone: replica 1 is behind (its last collective
    # failed), replica 0's survivor is ahead; no checkpoint is given to fall back to
    torn = Change(TORN_AT, DEGRADED, kill=DEAD, rejoin_port=free_port(), torn=(Member(1, 0), Member(1, 1)))
    sc = Scenario(CFG, 4, START, steps=STEPS, members=members_of(*START), changes=(torn,))
    results = run_workers(run_scenario, len(sc.members), (sc,), expect_exits=1, timeout_s=60)
    planned = Scenario(CFG, 4, START, steps=STEPS, members=members_of(*START), changes=(Change(TORN_AT, DEGRADED),))
    uninterrupted = run_workers(run_scenario, len(planned.members), (planned,), timeout_s=60)

    outcomes = {res["member"]: res["reports"][1]["torn"] for res in results.values()}
    assert outcomes == {(0, 1, 0): "updated", (1, 0, 0): "InjectedFault", (1, 1, 0): "InjectedFault"}
    for res in results.values():
        replay = res["reports"][2]
        assert replay["source"] == "live" and replay["step"] == TORN_AT, replay
        assert replay["behind"] == [], replay  # the members ahead undid their update instead
        assert res["step"] == STEPS
    assert_parity(results, reference_full(STEPS, lambda s: 4), STEPS)

    got, want = _final_states(results), _final_states(uninterrupted)
    assert set(got) == set(want)  # every unit of every parameter, weights and both moments
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        assert _rel_l2(got, want, kind) <= 1e-6, kind


@pytest.mark.slow
def test_a_member_behind_a_torn_step_holds_nothing_when_every_newest_copy_survived():
    # the dead member's units survive at the newer step on replica 0's member ahead, so the
    # job goes forward; the member left behind counts as holding nothing: the new layout is
    # planned without it and its units are re-sent, exactly as for a fresh process in its
    # place (what the soak's same-layout replay models: bench/soak_replay.rounds_from).
    # Planned with it as a holder, the layout differs, and so do the float sums. Two
    # replicas at TP 4 (the soak's job); one GPU of replica 1 is lost.
    start = (rp(0, range(4)), rp(1, range(4)))
    dead, behind = Member(1, 1), Member(0, 0)
    degraded = (rp(0, range(4)), rp(1, (0, 2, 3)))
    torn = Change(TORN_AT, degraded, kill=dead, rejoin_port=free_port(), torn=(behind,))
    runs = {}
    for name, change in (
        ("torn", torn),
        ("fresh", Change(TORN_AT + 1, degraded, kill=dead, rejoin_port=free_port(), restart=behind)),
        ("holder", Change(TORN_AT + 1, degraded, kill=dead, rejoin_port=free_port())),
    ):
        sc = Scenario(CFG, 4, start, steps=STEPS, members=members_of(*start), changes=(change,))
        runs[name] = run_workers(run_scenario, len(sc.members), (sc,), expect_exits=1, timeout_s=90)
    outcomes = {res["member"]: res["reports"][1]["torn"] for res in runs["torn"].values()}
    assert outcomes == {m: "InjectedFault" if m == tuple(behind) else "updated"
                        for m in members_of(*start) if m != dead}
    assert {res["reports"][2]["step"] for res in runs["torn"].values()} == {TORN_AT + 1}  # forward
    assert all(res["reports"][2]["behind"] == [tuple(behind)] for res in runs["torn"].values())
    assert all(res["reports"][1]["behind"] == [] for res in runs["holder"].values())  # no torn step
    states = {name: _final_states(results) for name, results in runs.items()}
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        assert _rel_l2(states["torn"], states["fresh"], kind) == 0.0, kind
    assert _rel_l2(states["torn"], states["holder"], "param") > 0.0


def test_rollback_step_needs_every_member_ahead_to_undo_one_step():
    a, b, c = Member(0, 0), Member(0, 1), Member(1, 0)
    assert rollback_step({a: (5, 4), b: (4, 3), c: (5, 4)}) == 4
    assert rollback_step({a: (5, 4), b: (4, None)}) == 4  # members behind need no undo state
    assert rollback_step({a: (5, None), b: (4, 3)}) is None  # one ahead cannot undo
    assert rollback_step({a: (5, 3), b: (4, 3)}) is None  # its undo state is of another step
    assert rollback_step({a: (6, 5), b: (4, 3)}) is None  # two steps apart
    assert rollback_step({a: (5, 4), b: (5, 4)}) is None  # not torn
    assert rollback_step({}) is None


def test_fault_hook_fires_once_at_its_step_and_rejects_bad_values():
    hook = FaultHook("3:fail")
    hook.before_update(2)
    with pytest.raises(InjectedFault, match="step 3"):
        hook.before_update(3)
    hook.before_update(3)  # the replay runs clean
    FaultHook(None).before_update(0)
    for bad in ("x:fail", "3:explode", "3"):
        with pytest.raises(ValueError, match="TPFLEX_TEST_FAULT_BEFORE_UPDATE"):
            FaultHook(bad)
