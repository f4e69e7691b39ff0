"""Dropout under NTP (issue 34): masks keyed by (seed, step, global sample, module path,
call, query head), with no RNG state, so a replica's TP members draw the same mask on a
replicated activation and a query head's attention-probability mask is the same
whichever member holds it, at any TP degree, as the single-process reference draws it.

Real gloo runs (``tpflex-train``, TP 4 x 2 with a kill and a drain to TP 3) against the HF
model trained in one process with the same keyed masks: losses, gradient norms and final
weights within 1e-5 relative, and every unit's state (the replicated parameters
included, ``_replicated:0``) bit-identical on every member holding it (``train`` asserts
it). In-process: the masks' properties, the self-test not being fooled by uncoordinated
masks, and the refusals."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from tpflex_trainer.ntp import dropout
from tpflex_trainer.ntp.errors import UnsupportedModelError
from tpflex_trainer.ntp.hf_adapter import HfAdapter
from transformers import AutoConfig

from tests.trainer.hf_support import (
    args,
    make_data,
    make_model_dir,
    parity_failures,
    reference_for,
    train,
)

P = 0.1


def _small(family: str, **kw):
    base = dict(vocab_size=96, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=6, num_key_value_heads=3, head_dim=4, max_position_embeddings=64)
    base.update(kw)
    return AutoConfig.for_model(family, **base)


# ---------------------------------------------------------------- real runs
@pytest.mark.timeout(300)
def test_llama_attention_dropout_through_a_kill_and_a_drain_to_tp3(tmp_path):
    """attention_dropout 0.1 (sdpa: recomputed in math form with the keyed mask), KV-group
    units, 2 micro-batches: TP 4 x 2, a member killed at step 3 (replica 0 at TP 3, the
    step replayed), replica 1 drained to TP 3 at step 6."""
    model = make_model_dir(tmp_path / "llama", "llama", heads=8, kv=4, attention_dropout=P)
    data = make_data(tmp_path / "tokens.npy")
    argv = args(model, data, tmp_path / "out", steps=10, events="3:kill=0:3,6:drain=1:2", micro_batches=2,
                clip_grad=1.0, warmup=2)
    summary = train(argv)  # asserts every unit, _replicated:0 included, bit-identical on its holders
    ref = reference_for(argv)
    assert parity_failures(summary, ref, tmp_path / "out") == []
    assert summary["degrees"][2:7] == [[4, 4], [3, 4], [3, 4], [3, 4], [3, 3]]


@pytest.mark.timeout(300)
def test_seed_oss_attention_and_residual_dropout_above_the_kv_groups(tmp_path):
    """Seed-OSS's own default dropout (attention 0.1, residual 0.1 on the attention and MLP
    outputs after the row-parallel all-reduce: replicated activations), query-head units
    over 2 KV heads, a drain from TP 4 to 3."""
    model = make_model_dir(tmp_path / "seed", "seed_oss", heads=8, kv=2, attention_dropout=P, residual_dropout=P)
    data = make_data(tmp_path / "tokens.npy")
    argv = args(model, data, tmp_path / "out", steps=10, events="4:drain=0:1")
    summary = train(argv)
    ref = reference_for(argv)
    assert parity_failures(summary, ref, tmp_path / "out") == []
    assert summary["degrees"][4] == [3, 4]
    # dropout really ran: the reference without it trains to other losses
    from tpflex_trainer.ntp.hf_reference import ReferenceSettings, reference_run

    s = ReferenceSettings(steps=2, global_batch=8, lr=3e-3)
    with_p = reference_run(str(model), np.load(data), s)["losses"]
    cfg = AutoConfig.from_pretrained(model)
    cfg.attention_dropout = cfg.residual_dropout = 0.0
    cfg.save_pretrained(model)
    assert reference_run(str(model), np.load(data), s)["losses"] != pytest.approx(with_p, rel=1e-6)


# ---------------------------------------------------------------- the masks
def test_a_heads_mask_does_not_depend_on_who_holds_it_or_the_micro_batch_split():
    """The attention probabilities of query heads (2, 5) drawn by a member holding only them
    equal those rows of the full model's draw; samples drawn in two micro-batches equal the
    whole batch's; another step or seed draws another mask."""
    x = torch.ones(4, 8, 5, 5)

    class Attn(torch.nn.Module):
        def __init__(self, heads):
            super().__init__()
            self.heads = heads

        def forward(self, t):
            return torch.nn.functional.dropout(t, p=0.3, training=True)

    def draw(heads, first, t, step=7, seed=1):
        m = torch.nn.Sequential()
        m.add_module("attn", Attn(heads))
        dropout.keyed(m, lambda path, mod: tuple(mod.heads) if path == "attn" else None)
        with dropout.scope(seed, step, first, t.shape[0], hidden=99):
            return m(t)

    full = draw(range(8), 0, x)
    assert 0.2 < float((full == 0).float().mean()) < 0.4
    assert torch.equal(draw([2, 5], 0, x[:, [2, 5]]), full[:, [2, 5]])
    assert torch.equal(torch.cat([draw(range(8), 0, x[:1]), draw(range(8), 1, x[1:])]), full)
    assert not torch.equal(draw(range(8), 0, x, step=8), full)
    assert not torch.equal(draw(range(8), 0, x, seed=2), full)


def test_the_self_test_refuses_masks_drawn_from_torchs_rng(monkeypatch):
    """The fidelity self-test trains the miniature with dropout on, through the NTP path
    (threads) and HF's module with the same keyed masks: it passes; with the coordination
    removed (each draws from torch's RNG) it refuses the model, naming where it differs."""
    cfg = _small("llama", attention_dropout=P)
    assert HfAdapter(cfg, 4).fidelity is not None
    monkeypatch.setattr(dropout, "scope", lambda *a, **k: contextlib.nullcontext())
    with pytest.raises(UnsupportedModelError, match="failed the fidelity self-test"):
        HfAdapter(_small("llama", attention_dropout=0.2), 4)


def test_a_kernel_drawing_its_own_mask_is_refused_naming_the_construct():
    """Flash / flex attention draw the attention-dropout mask inside the kernel: refused
    (before training, at the adapter's analysis); eager and sdpa are keyed."""
    from types import SimpleNamespace

    from tpflex_trainer.ntp.hf_plan import check_dropout

    model = torch.nn.Module()
    model.self_attn = torch.nn.Module()
    model.self_attn.attention_dropout = P
    for impl in ("eager", "sdpa"):
        model.config = SimpleNamespace(_attn_implementation=impl)
        check_dropout(model, model.config)
    model.config = SimpleNamespace(_attn_implementation="flash_attention_2")
    with pytest.raises(UnsupportedModelError, match="self_attn: attention dropout 0.1 with attn_implementation "
                                                    "'flash_attention_2': the kernel draws its own mask"):
        check_dropout(model, model.config)
    model.self_attn.attention_dropout = 0.0
    check_dropout(model, model.config)


def test_dropout_on_a_sharded_mlp_activation_is_refused():
    """A dropout on the MLP's intermediate activation (column-parallel: a member holds only
    its columns) cannot be keyed by unit: refused by the self-test, naming the module."""
    from transformers.models.llama import modeling_llama

    class DroppyMLP(modeling_llama.LlamaMLP):
        def forward(self, x):
            act = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
            return self.down_proj(torch.nn.functional.dropout(act, p=P, training=self.training))

    original = modeling_llama.LlamaMLP
    modeling_llama.LlamaMLP = DroppyMLP
    try:
        with pytest.raises(UnsupportedModelError, match=r"mlp: dropout 0.1 on an activation of shape"):
            HfAdapter(_small("llama", hidden_size=24, intermediate_size=40), 4)
    finally:
        modeling_llama.LlamaMLP = original
