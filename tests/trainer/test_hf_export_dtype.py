"""The HF export keeps the model's dtype: a bf16 model directory comes out as bf16 tensors
with ``"dtype": "bfloat16"`` in config.json (the runtime trains fp32 master weights), and
building the adapter does not change the user's config object."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.harness import run_workers
from tests.trainer.hf_support import VOCAB


def _bf16_model_dir(path: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                               head_dim=4, max_position_embeddings=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def _assert_same_bf16_model(model: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    given, written = load_file(model / "model.safetensors"), load_file(out / "model.safetensors")
    assert given.keys() == written.keys()
    assert {str(t.dtype) for t in written.values()} == {"torch.bfloat16"}
    assert all(torch.equal(given[k], written[k]) for k in given)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert next(AutoModelForCausalLM.from_pretrained(out).parameters()).dtype == torch.bfloat16


def test_adapter_leaves_the_config_alone_and_writes_the_models_dtype(tmp_path):
    from tpflex_trainer.ntp.hf_adapter import HfAdapter, load_config
    from tpflex_trainer.ntp.hf_io import write_hf_dir

    model = _bf16_model_dir(tmp_path / "bf16")
    config = load_config(model)
    before = (config.to_dict(), config.dtype, config._attn_implementation)
    ad = HfAdapter(config, 2, model)  # builds the model class on the meta device
    state = ad.full_state(0)  # what a member holds: fp32 master weights
    assert {t.dtype for t in state.values()} == {torch.float32}
    assert (config.to_dict(), config.dtype, config._attn_implementation) == before
    write_hf_dir(tmp_path / "out", ad.config, state)
    _assert_same_bf16_model(model, tmp_path / "out")
    assert config.dtype == torch.bfloat16  # the writer does not change it either


def _export(rank: int, world_size: int, model: str, out: str) -> list[str]:
    from tpflex_trainer.ntp.layout import Member, ReplicaPlacement
    from tpflex_trainer.ntp.runtime import NtpRuntime

    rt = NtpRuntime(model, 2, Member(0, rank))
    rt.start((ReplicaPlacement(0, tuple(range(world_size)), 4),), {Member(0, r): r for r in range(world_size)})
    return rt.export_hf(out)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_export_hf_of_a_bf16_model_is_bf16(tmp_path):
    model = _bf16_model_dir(tmp_path / "bf16")
    out = tmp_path / "out"
    files = run_workers(_export, 2, (str(model), str(out)), timeout_s=150)
    assert files[0] == ["config.json", "model.safetensors"] and files[1] == []
    _assert_same_bf16_model(model, out)
