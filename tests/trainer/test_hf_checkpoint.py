"""Layout-independent checkpoints of a Hugging Face model: saved at TP 2 (query-head units
with replicated KV heads: base TP 4 > 2 KV heads), loaded by fresh processes at TP 3; the
fingerprint is checked field by field."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from tpflex_trainer.ntp.errors import CheckpointMismatchError

from tests.trainer.harness import run_workers
from tests.trainer.hf_support import make_data, make_model_dir

pytestmark = pytest.mark.slow


def _train_and_save(rank: int, world_size: int, model: str, data: str, ckpt: str, out: str) -> int:
    import numpy as np
    from tpflex_trainer.ntp.layout import Member, ReplicaPlacement
    from tpflex_trainer.ntp.optim import AdamSettings, TrainSettings
    from tpflex_trainer.ntp.runtime import NtpRuntime
    from tpflex_trainer.train.data import replica_batch

    rt = NtpRuntime(model, 4, Member(0, rank), adam=AdamSettings(lr=3e-3, weight_decay=0.1),
                    train=TrainSettings(clip_grad=1.0))
    rt.start((ReplicaPlacement(0, tuple(range(world_size)), 4),), {Member(0, r): r for r in range(world_size)})
    tokens = np.load(data)
    for step in range(2):
        rt.train_step(*replica_batch(tokens, step, [4], 0))
    rt.save_checkpoint(ckpt)
    rt.export_hf(out)
    return rt.step


def _load_and_export(rank: int, world_size: int, model: str, ckpt: str, out: str) -> int:
    from tpflex_trainer.ntp.layout import Member, ReplicaPlacement
    from tpflex_trainer.ntp.runtime import NtpRuntime

    rt = NtpRuntime(model, 4, Member(0, rank + 1))
    slots = tuple(range(1, world_size + 1))
    report = rt.start((ReplicaPlacement(0, slots, 4),), {Member(0, s): s - 1 for s in slots}, checkpoint=ckpt)
    assert report.source == "checkpoint"
    rt.export_hf(out)
    return rt.step


@pytest.mark.timeout(300)
def test_hf_checkpoint_loads_into_another_layout(tmp_path):
    from tpflex_trainer.ntp.checkpoint import CheckpointReader
    from tpflex_trainer.ntp.hf_adapter import HfAdapter

    model = make_model_dir(tmp_path / "qwen3", "qwen3", heads=8, kv=2, tied=True)
    data = make_data(tmp_path / "tokens.npy")
    ckpt, a, b = str(tmp_path / "ckpt"), str(tmp_path / "a"), str(tmp_path / "b")
    assert set(run_workers(_train_and_save, 2, (str(model), str(data), ckpt, a), timeout_s=140).values()) == {2}
    assert set(run_workers(_load_and_export, 3, (str(model), ckpt, b), timeout_s=140).values()) == {2}
    saved, loaded = load_file(f"{a}/model.safetensors"), load_file(f"{b}/model.safetensors")
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    initial = load_file(model / "model.safetensors")
    assert not torch.equal(saved["model.norm.weight"], initial["model.norm.weight"])  # it trained
    other = make_model_dir(tmp_path / "llama", "llama", heads=8, kv=2, tied=True)
    with pytest.raises(CheckpointMismatchError) as exc:
        CheckpointReader(ckpt, HfAdapter.from_pretrained_dir(other, 4).fingerprint())
    assert exc.value.field == "model_type"
