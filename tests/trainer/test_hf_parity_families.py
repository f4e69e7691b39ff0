"""Families that trained silently wrong before HF's own forward ran around the shards,
now trained by ``tpflex-train`` (real gloo processes) at TP 4 x 2 through a kill, a drain
and the repairs, against the HF model itself in one process (torch.optim.AdamW, clipping,
the same schedule and batches): per-step loss and gradient norm within 1e-5 relative,
final weights within 1e-5 relative L2 over the whole model.

- Granite: ``logits_scaling`` (the logits divided after the head), ``embedding_multiplier``,
  ``residual_multiplier`` and ``attention_multiplier``;
- SmolLM3 with ``pad_token_id`` set (the embedding's ``padding_idx``: the padding row gets
  no gradient from the lookup) and the pad token in the data, plus its per-layer NoPE list;
- GLM 4: the fused ``gate_up_proj`` (``colwise_gather_output``; units are each block's gate
  and up rows), read from its safetensors and exported back in HF's layout.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.trainer.hf_support import (
    args,
    make_data,
    make_model_dir,
    parity_failures,
    reference_for,
    train,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EVENTS = "2:kill=0:3,4:drain=1:2,6:undrain=1:2,7:undrain=0:3"
DEGREES = [[4, 4]] * 2 + [[3, 4]] * 2 + [[3, 3]] * 2 + [[3, 4]] + [[4, 4]]


def _run(tmp_path, model, data):
    argv = args(model, data, tmp_path / "out", steps=8, events=EVENTS, warmup=2, min_lr_ratio=0.1,
                weight_decay=0.1, clip_grad=0.5, betas="0.9,0.95")
    summary = train(argv)
    ref = reference_for(argv)
    assert parity_failures(summary, ref, tmp_path / "out") == []
    assert summary["degrees"] == DEGREES
    return summary, ref


def test_granite_logits_scaling_and_multipliers(tmp_path):
    model = make_model_dir(tmp_path / "granite", "granite", heads=8, kv=4, logits_scaling=8.0,
                           embedding_multiplier=6.0, residual_multiplier=0.3, attention_multiplier=0.2)
    _, ref = _run(tmp_path, model, make_data(tmp_path / "tokens.npy"))
    assert ref["losses"][-1] < ref["losses"][0]


def test_smollm3_with_a_pad_token(tmp_path):
    pad = 3
    model = make_model_dir(tmp_path / "smollm3", "smollm3", heads=8, kv=2, pad_token_id=pad)
    data = make_data(tmp_path / "tokens.npy")
    tokens = np.load(data)
    tokens[:, ::5] = pad  # the padding row is looked up in every row
    np.save(data, tokens)
    _run(tmp_path, model, data)


def test_glm4_fused_gate_up(tmp_path):
    model = make_model_dir(tmp_path / "glm4", "glm4", heads=8, kv=4, pad_token_id=0, eos_token_id=1,
                           bos_token_id=2)
    _run(tmp_path, model, make_data(tmp_path / "tokens.npy"))


def test_gpt_neox_own_names_fused_qkv_by_head(tmp_path):
    """GPT-NeoX: its own module names (embed_in, final_layer_norm), query_key_value fused
    per head (q, k, v rows of each head in turn: a unit is a head's rows), partial rotary,
    parallel attention + MLP, biases; read from and exported to its safetensors."""
    model = make_model_dir(tmp_path / "gpt_neox", "gpt_neox", heads=8, kv=8, use_parallel_residual=True,
                           partial_rotary_factor=0.5)
    _run(tmp_path, model, make_data(tmp_path / "tokens.npy"))


def test_olmo2_whole_projection_qk_norm(tmp_path):
    """OLMo 2: q_norm / k_norm over the whole q / k projection as a distributed norm (its
    weight sharded like the projection's rows, the sums of squares all-reduced over the
    replica's TP members) through the degree changes."""
    model = make_model_dir(tmp_path / "olmo2", "olmo2", heads=8, kv=4)
    _run(tmp_path, model, make_data(tmp_path / "tokens.npy"))


def test_falcon_h1_derived_plan_with_a_replicated_mamba_mixer(tmp_path):
    """Falcon-H1: HF's plan shards only the embedding, so tpflex derives one from its
    modules (attention and MLP column/row-parallel); every layer's Mamba-2 mixer is not
    planned and runs whole on every member, on the same inputs (its gradient is the same
    on each, not summed)."""
    model = make_model_dir(tmp_path / "falcon_h1", "falcon_h1", heads=8, kv=4, mamba_n_heads=8, mamba_d_head=8,
                           mamba_d_ssm=64, mamba_d_state=8, mamba_chunk_size=4, mamba_expand=2)
    _run(tmp_path, model, make_data(tmp_path / "tokens.npy"))
