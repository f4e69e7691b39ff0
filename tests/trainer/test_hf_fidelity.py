"""Exact or refused: HF's own forward runs around the sharded modules (the logits HF
produces, post-processing included, go to the vocab-parallel loss; the model's own
embedding module with its ``padding_idx`` and scale; the configured attention), dropout
passes the self-test (its masks keyed per unit, see test_hf_dropout.py), and the fidelity self-test refuses a model whose sharded forward or backward
differs from HF's, naming where the gradients start to differ. In-process (the self-test's
thread members): no process group."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from tpflex_trainer.ntp import hf_miniature, hf_selftest
from tpflex_trainer.ntp.errors import UnsupportedModelError
from tpflex_trainer.ntp.hf_adapter import HfAdapter
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP


def _small(family: str, **kw):
    base = dict(vocab_size=96, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=6, num_key_value_heads=3, head_dim=4, max_position_embeddings=64)
    base.update(kw)
    return AutoConfig.for_model(family, **base)


# ---------------------------------------------------------------- planted quirks
class CentredLogitsConfig(LlamaConfig):
    model_type = "tpflex_test_centred_logits"


class CentredLogitsForCausalLM(LlamaForCausalLM):
    """A quirk no elementwise rule covers: the logits are normalised over the whole
    vocabulary after the head (each member would normalise over its own columns only)."""

    config_class = CentredLogitsConfig

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits / out.logits.norm(dim=-1, keepdim=True)
        return out


class ScaledLogitsConfig(LlamaConfig):
    model_type = "tpflex_test_scaled_logits"


class ScaledLogitsForCausalLM(LlamaForCausalLM):
    """The issue's example quirk: logits scaled after the head (elementwise: HF's own
    forward runs it on each member's columns, so it trains exactly, not refused)."""

    config_class = ScaledLogitsConfig

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 0.37
        return out


class MeanMLP(LlamaMLP):
    def forward(self, x):  # a mean over the (sharded) intermediate columns
        act = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(act - act.mean(dim=-1, keepdim=True))


class MeanMlpConfig(LlamaConfig):
    model_type = "tpflex_test_mean_mlp"


class MeanMlpForCausalLM(LlamaForCausalLM):
    config_class = MeanMlpConfig

    def __init__(self, config):
        super().__init__(config)
        layer = self.model.layers[1]
        layer.mlp = MeanMLP(config)


for cfg_cls, model_cls in ((CentredLogitsConfig, CentredLogitsForCausalLM),
                           (ScaledLogitsConfig, ScaledLogitsForCausalLM), (MeanMlpConfig, MeanMlpForCausalLM)):
    AutoConfig.register(cfg_cls.model_type, cfg_cls, exist_ok=True)
    AutoModelForCausalLM.register(cfg_cls, model_cls, exist_ok=True)


def _quirky(cls, **kw):
    cfg = cls(**{**_small("llama").to_dict(), **kw})
    cfg.base_model_tp_plan = dict(LlamaConfig().base_model_tp_plan)
    return cfg


def test_the_self_test_refuses_a_logit_quirk_naming_the_output_layer():
    with pytest.raises(UnsupportedModelError, match="self-test") as exc:
        HfAdapter(_quirky(CentredLogitsConfig), 2)
    assert exc.value.code == "self_test_failed"
    assert "starting (going back from the loss) at module lm_head" in str(exc.value), str(exc.value)


def test_the_self_test_names_the_layer_whose_gradients_differ():
    with pytest.raises(UnsupportedModelError) as exc:
        HfAdapter(_quirky(MeanMlpConfig), 2)
    # the MLP of layer 1 is wrong: its down_proj is where the gradients start to differ
    assert "the forward differs first at the output of module model.layers.1.mlp.down_proj" in str(exc.value), str(exc.value)


def test_scaled_logits_are_run_by_the_models_own_forward_and_pass():
    ad = HfAdapter(_quirky(ScaledLogitsConfig), 2)
    assert ad.fidelity is not None and ad.fidelity.tensor_parallel is None


def test_skipping_the_self_test_warns_loudly(monkeypatch, caplog):
    monkeypatch.setenv(hf_selftest.SKIP_ENV, "1")
    with caplog.at_level(logging.WARNING):
        ad = HfAdapter(_quirky(CentredLogitsConfig, num_hidden_layers=3), 2)  # a config not cached
    assert ad.fidelity is None
    assert "FIDELITY SELF-TEST SKIPPED" in caplog.text


# ---------------------------------------------------------------- families that were wrong
@pytest.mark.parametrize("family,kw", [
    ("granite", {"logits_scaling": 4.0, "embedding_multiplier": 3.0, "residual_multiplier": 0.5}),
    ("cohere", {"logit_scale": 0.25}),
    ("smollm3", {"pad_token_id": 5}),
    ("gemma3_text", {"pad_token_id": 0, "sliding_window": 4, "final_logit_softcapping": 2.0}),
    ("gemma2", {"final_logit_softcapping": 3.0, "attn_logit_softcapping": 5.0}),
])
def test_families_that_trained_silently_wrong_now_pass_the_self_test(family, kw):
    ad = HfAdapter(_small(family, **kw), 3)
    assert ad.fidelity is not None and ad.fidelity.tensor_parallel is None, ad.fidelity
    assert ad.fidelity.layouts  # it ran layouts, not nothing


def test_the_padding_row_gets_no_gradient_under_ntp():
    """``padding_idx`` (HF's embedding) kept by the vocab-parallel embedding: the NTP
    path's gradient of the padding row is zero, as HF's is, although the pad is looked up."""
    cfg = _small("llama", pad_token_id=7)
    ad = HfAdapter(cfg, 2)
    model = hf_selftest._reference(hf_miniature.miniature_config(cfg), 0)
    mini = HfAdapter(hf_miniature.miniature_config(cfg), 2, self_test=False)
    batch = hf_selftest._batch(model.config, 1)
    assert bool((batch[0] == 7).any())
    state = {k: v.detach() for k, v in model.state_dict().items()}
    _, grads, _, _ = hf_selftest._ntp_grads(mini, state, batch, 2)
    embed = grads["model.embed_tokens.weight"]
    assert float(embed[7].abs().sum()) == 0.0
    assert float(embed.abs().sum()) > 0
    assert ad.fidelity.tensor_parallel is None


def test_the_models_own_attention_implementation_is_kept():
    from tpflex_trainer.ntp.hf_adapter import build_meta_model

    cfg = _small("gemma2")
    cfg._attn_implementation = "eager"
    assert build_meta_model(cfg).config._attn_implementation == "eager"
    cfg = _small("llama")
    cfg._attn_implementation = "sdpa"
    assert build_meta_model(cfg).config._attn_implementation == "sdpa"


@pytest.mark.parametrize("family,field", [("seed_oss", "attention_dropout"), ("seed_oss", "residual_dropout"),
                                          ("llama", "attention_dropout"), ("qwen2", "attention_dropout")])
def test_dropout_passes_the_self_test(family, field):
    """Dropout is no longer refused: its masks are keyed by sample, module and query head
    (``dropout``), and the self-test trains the miniature with them on."""
    quiet = {k: 0.0 for k in _small(family).to_dict() if "dropout" in k}
    assert HfAdapter(_small(family, **{**quiet, field: 0.1}), 2).fidelity is not None


def test_an_embedding_with_extra_parameters_is_refused():
    class Shifted(nn.Embedding):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.shift = nn.Parameter(torch.zeros(self.embedding_dim))

    cfg = _small("llama")
    from tpflex_trainer.ntp.hf_adapter import build_meta_model
    from tpflex_trainer.ntp.hf_plan import analyse

    model = build_meta_model(cfg)
    model.model.embed_tokens = Shifted(96, 24)
    with pytest.raises(UnsupportedModelError, match="embed_tokens is not an nn.Embedding"):
        analyse(model, cfg, 2)


def test_a_fused_projection_reads_and_exports_unit_major(tmp_path):
    """GLM 4's ``gate_up_proj`` (two chunks, gate and up): a member's units are read from
    the safetensors as each unit's gate rows then its up rows, and the canonical tensor goes
    back to HF's layout exactly (export); the adapter itself passes the self-test."""
    from tpflex_trainer.ntp.config import to_canonical, to_user
    from tpflex_trainer.ntp.hf_io import SafetensorsReader

    cfg = _small("glm4", pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    ad = HfAdapter(cfg, 3, tmp_path)
    assert ad.fidelity.tensor_parallel is None
    spec = next(s for s in ad.specs if s.name.endswith("layers.0.mlp.gate_up_proj.weight"))
    assert len(spec.chunk_rows) == 2
    from safetensors.torch import load_file

    user = load_file(tmp_path / "model.safetensors")[spec.name]
    width = user.shape[0] // 2
    canon = to_canonical(spec, user)
    r = spec.unit_rows // 2
    for u in range(spec.n_units):  # unit u: its gate rows, then its up rows
        block = canon[u * spec.unit_rows:(u + 1) * spec.unit_rows]
        assert torch.equal(block[:r], user[u * r:(u + 1) * r])
        assert torch.equal(block[r:], user[width + u * r:width + (u + 1) * r])
    assert torch.equal(to_user(spec, canon), user)
    units = (0, 2, 3)
    got = SafetensorsReader(tmp_path).rows(spec, units)
    want = torch.cat([canon[u * spec.unit_rows:(u + 1) * spec.unit_rows] for u in units])
    assert torch.equal(got, want)
