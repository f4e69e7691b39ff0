"""Pipeline stages with the built-in GPT through the runtime API: loss parity with the
single-process reference, and checkpoints written by every stage (families qualified by
their stage) that load into other per-stage degrees in fresh processes, and that a
one-stage job refuses."""

from __future__ import annotations

import pytest
from tpflex_trainer.ntp.checkpoint import CheckpointReader
from tpflex_trainer.ntp.errors import CheckpointMismatchError
from tpflex_trainer.ntp.layout import Member, ReplicaPlacement
from tpflex_trainer.ntp.optim import TrainSettings

from tests.trainer.harness import run_workers
from tests.trainer.scenarios import LR, SEED, local_batch
from tests.trainer.test_parity import CFG, REL_TOL, reference

pytestmark = pytest.mark.slow

MEMBERS = [Member(0, s, k) for k in range(2) for s in range(2)]  # 1 replica x PP 2 x TP 2
FULL = (ReplicaPlacement(0, (0, 1), 4, 0), ReplicaPlacement(0, (0, 1), 4, 1))
DEGRADED = (ReplicaPlacement(0, (1,), 4, 0), ReplicaPlacement(0, (0, 1), 4, 1))  # stage 0 at TP 1


def _train(rank: int, world_size: int, placements, steps: range, save_at: int | None, path: str,
           load: bool) -> dict:
    from tpflex_trainer.ntp.optim import AdamSettings
    from tpflex_trainer.ntp.runtime import NtpRuntime

    me = MEMBERS[rank]
    world = {m: i for i, m in enumerate(MEMBERS)}
    rt = NtpRuntime(CFG, 2, me, seed=SEED, adam=AdamSettings(lr=LR), stages=2,
                    train=TrainSettings(micro_batches=2))
    report = rt.start(placements, world, checkpoint=path if load else None)
    losses = {}
    for step in steps:
        if step == save_at:
            rt.save_checkpoint(path)
        if rt.active:
            losses[step] = rt.train_step(*local_batch(rt, step))
    rt.close()
    return {"member": tuple(me), "source": report.source, "losses": losses}


def test_pipeline_parity_and_a_checkpoint_into_other_stage_degrees(tmp_path):
    ref = reference(5, lambda s: 4)
    first = run_workers(_train, 4, (FULL, range(4), 3, str(tmp_path), False))
    for res in first.values():  # every stage reports the global loss (carried from the last stage)
        assert sorted(res["losses"]) == [0, 1, 2, 3]
        for step, loss in res["losses"].items():
            assert abs(loss - ref[step]) <= REL_TOL * ref[step], (res["member"], step, loss, ref[step])
    reader = CheckpointReader(tmp_path, _fingerprint())
    assert reader.step == 3
    assert reader.payload("stage0.vocab", 0).numel() > 0 and reader.payload("stage1.vocab", 0).numel() > 0
    second = run_workers(_train, 4, (DEGRADED, range(3, 5), None, str(tmp_path), True))
    active = [r for r in second.values() if r["losses"]]
    assert len(active) == 3  # (0, slot 0, stage 0) is idle: stage 0 runs at TP 1
    for res in active:
        assert res["source"] == "checkpoint" and sorted(res["losses"]) == [3, 4]
        for step, loss in res["losses"].items():
            assert abs(loss - ref[step]) <= REL_TOL * ref[step], (res["member"], step, loss, ref[step])
    with pytest.raises(CheckpointMismatchError) as err:  # a one-stage job cannot load it
        CheckpointReader(tmp_path, CFG)
    assert err.value.field == "pipeline_stages"


def _fingerprint() -> dict:
    from tpflex_trainer.ntp.adapter import GPTAdapter
    from tpflex_trainer.ntp.stage_adapter import stage_view

    return stage_view(GPTAdapter(CFG), 0, 2).fingerprint()
