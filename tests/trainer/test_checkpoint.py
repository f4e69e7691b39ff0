"""Layout-independent checkpoints: save in one layout, load into another (fresh
processes), roll back to the checkpoint when no live member holds some units, refuse a
checkpoint of another model config."""

from __future__ import annotations

import dataclasses

import pytest
from tpflex_trainer.ntp.checkpoint import CheckpointReader
from tpflex_trainer.ntp.errors import CheckpointError, CheckpointMismatchError
from tpflex_trainer.ntp.layout import Member

from tests.support.ports import free_port
from tests.trainer.harness import run_workers
from tests.trainer.scenarios import Change, Scenario, run_scenario
from tests.trainer.test_parity import CFG, assert_parity, members_of, reference_full, rp

pytestmark = pytest.mark.slow


def test_checkpoint_saved_in_one_layout_loads_into_another(tmp_path):
    first = (rp(0, range(4)), rp(1, range(3)))
    save = Scenario(CFG, 4, first, steps=6, members=members_of(*first), save_at=5, checkpoint_dir=str(tmp_path))
    run_workers(run_scenario, len(save.members), (save,))
    assert CheckpointReader(tmp_path, CFG).step == 5
    second = (rp(0, (1, 3)), rp(1, range(3)))  # other degrees, other slots, fresh processes
    resume = Scenario(CFG, 4, second, steps=8, members=members_of(*second), start_checkpoint=str(tmp_path))
    results = run_workers(run_scenario, len(resume.members), (resume,))
    for res in results.values():
        assert res["reports"][0]["source"] == "checkpoint" and res["reports"][0]["step"] == 5
    # losses and gradient norms of steps 5..7, final weights and Adam moments
    assert_parity(results, reference_full(8, lambda s: 4), 8, first=5)


def test_rollback_to_checkpoint_when_no_live_member_holds_a_unit(tmp_path):
    start = (rp(0, range(3)),)
    dead = Member(0, 1)
    change = Change(
        6, (rp(0, (0, 2)),), kill=dead, rejoin_port=free_port(),
        checkpoint=str(tmp_path), expect_unavailable=True,
    )
    sc = Scenario(CFG, 4, start, steps=9, members=members_of(*start), save_at=4,
                  checkpoint_dir=str(tmp_path), changes=(change,))
    results = run_workers(run_scenario, len(sc.members), (sc,), expect_exits=1)
    assert len(results) == 2
    for res in results.values():
        refused, rollback = res["reports"][1:]
        assert refused == {"refused": "units_unavailable"}
        assert rollback["source"] == "checkpoint" and rollback["step"] == 4
    assert_parity(results, reference_full(9, lambda s: 2), 9)


def test_checkpoint_of_another_config_is_refused_naming_the_field(tmp_path):
    start = (rp(0, range(2)),)
    sc = Scenario(CFG, 4, start, steps=1, members=members_of(*start), save_at=0, checkpoint_dir=str(tmp_path))
    run_workers(run_scenario, len(sc.members), (sc,))
    with pytest.raises(CheckpointMismatchError) as err:
        CheckpointReader(tmp_path, dataclasses.replace(CFG, hidden=64, n_heads=8))
    assert err.value.field == "hidden" and "hidden" in str(err.value)
    with pytest.raises(CheckpointError):
        CheckpointReader(tmp_path / "nowhere", CFG)
