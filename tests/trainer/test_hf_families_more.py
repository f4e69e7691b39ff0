"""Families made exact for issue 34 beyond the Llama layout, checked in-process by the
fidelity self-test (NTP threads against HF's own module, losses and every gradient) at
configs other than the coverage table's defaults: the model's own module names (GPT-NeoX's
``embed_in`` / ``final_layer_norm``, GPT-J's and CodeGen's ``wte`` / ``h`` / ``ln_f``),
fused q/k/v by head (GPT-NeoX) and by ``mp_num`` block (CodeGen), parallel attention + MLP
blocks, partial rotary, and OLMo 2's whole-projection q/k RMSNorm as a distributed norm
(one all-reduce of sums of squares). And the refusals the self-test must still give when
the layout or the norm is wrong."""

from __future__ import annotations

import pytest
import torch
from tpflex_trainer.ntp import hf_layers, hf_miniature, hf_plan, hf_selftest
from tpflex_trainer.ntp.errors import UnsupportedModelError
from tpflex_trainer.ntp.hf_adapter import HfAdapter
from transformers import AutoConfig

MHA = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)


def _passes(cfg, base_tp: int) -> HfAdapter:
    ad = HfAdapter(cfg, base_tp)
    assert ad.fidelity is not None and ad.fidelity.tensor_parallel is None, ad.fidelity
    assert ad.fidelity.layouts and ad.fidelity.pipeline is None, ad.fidelity
    return ad


@pytest.mark.parametrize("family,kw", [
    ("gpt_neox", {"intermediate_size": 48, "use_parallel_residual": True, "tie_word_embeddings": False}),
    ("gpt_neox", {"intermediate_size": 48, "use_parallel_residual": False, "attention_bias": False}),
    ("gptj", {"rotary_dim": 4, "n_inner": 48, "tie_word_embeddings": False}),
    ("codegen", {"rotary_dim": 2, "n_inner": 48, "tie_word_embeddings": False}),
])
def test_own_names_and_fused_layouts_pass_the_self_test(family, kw):
    ad = _passes(AutoConfig.for_model(family, **MHA, **kw), 2)
    assert ad.plan.embed in ("embed_in", "wte") and ad.plan.norm in ("final_layer_norm", "ln_f")


def test_codegen_units_are_its_mp_num_blocks():
    cfg = AutoConfig.for_model("codegen", **{**MHA, "num_attention_heads": 8}, rotary_dim=2, n_inner=48)
    ad = HfAdapter(cfg, 2, self_test=False)
    qkv = next(s for s in ad.specs if s.name.endswith("h.0.attn.qkv_proj.weight"))
    # 4 blocks (mp_num) of 2 heads: a unit is a block's q, v and k rows, contiguous
    assert ad.unit_counts["attn"] == 4 and qkv.unit_rows == 3 * 2 * 4 and qkv.chunk_rows == ()
    with pytest.raises(UnsupportedModelError, match="mp_num"):
        HfAdapter(cfg, 5, self_test=False)  # above its 4 blocks


@pytest.mark.parametrize("family", ["olmo2", "olmo3"])
@pytest.mark.parametrize("kv", [4, 2])
def test_olmo_whole_projection_qk_norm_is_a_distributed_norm(family, kv):
    cfg = AutoConfig.for_model(family, vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=kv, max_position_embeddings=64)
    ad = _passes(cfg, 2)
    specs = {s.name: s for s in ad.specs}
    q, k = specs["model.layers.0.self_attn.q_norm.weight"], specs["model.layers.0.self_attn.k_norm.weight"]
    # sharded like the projections' rows: a KV group's query heads, its K head
    assert (q.family, q.unit_rows) == ("attn", 64 // kv) and (k.family, k.unit_rows) == ("attn", 8)
    with pytest.raises(UnsupportedModelError, match="above the KV heads"):
        HfAdapter(cfg, kv + 1, self_test=False)


def test_a_norm_over_the_members_columns_only_is_refused(monkeypatch):
    """Without the all-reduce of the sums of squares each member would normalise over its
    own heads: the self-test must refuse it, naming the attention block."""

    def local_only(self, x):
        h = x.to(torch.float32)
        return (self.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    monkeypatch.setattr(hf_layers.DistributedRMSNorm, "forward", local_only)
    monkeypatch.setattr(hf_selftest, "_CACHE", {})
    cfg = AutoConfig.for_model("olmo2", vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
    with pytest.raises(UnsupportedModelError, match="self_attn"):
        HfAdapter(cfg, 2)


def test_gpt_neox_read_as_blocked_q_k_v_is_refused(monkeypatch):
    """GPT-NeoX's query_key_value interleaves q, k, v per head; read as Phi-3's blocked
    layout (all q rows, then k, then v) the self-test refuses it."""
    monkeypatch.setattr(hf_plan, "PER_HEAD_QKV", ())
    monkeypatch.setattr(hf_selftest, "_CACHE", {})
    cfg = AutoConfig.for_model("gpt_neox", **MHA, intermediate_size=48)
    with pytest.raises(UnsupportedModelError, match="attention"):
        HfAdapter(cfg, 2)


@pytest.mark.parametrize("family", ["ministral", "hunyuan_v1_dense"])
def test_a_config_that_leaves_head_dim_none_builds(family):
    """Ministral's and HunYuan's default configs leave head_dim None (their models then
    fail to build): the miniature sets it. HunYuan's plan shards only the embedding: tpflex
    derives one from its modules (``hf_derived_plan``)."""
    mini = hf_miniature.miniature_config(AutoConfig.for_model(family))
    assert mini.head_dim == hf_miniature.HIDDEN_PER_HEAD
    assert _passes(mini, 2).plan.source == ("hf" if family == "ministral" else "derived")


@pytest.mark.parametrize("base_tp", [2, 5])
def test_granite_swa_sinks_are_sharded_with_their_heads(base_tp):
    """Granite-SWA's plan shards the per-head ``self_attn.sinks`` parameter (``colwise``)
    and marks the attention ``local_params``: the sinks go with the attention units (a KV
    group's query heads; one head above the KV heads)."""
    cfg = AutoConfig.for_model("granite_swa", vocab_size=96, hidden_size=32, intermediate_size=48,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               max_position_embeddings=64, sliding_window=6)
    ad = HfAdapter(cfg, base_tp)
    assert ad.fidelity.tensor_parallel is None, ad.fidelity
    sinks = next(s for s in ad.specs if s.name.endswith("layers.0.self_attn.sinks"))
    assert (sinks.family, sinks.unit_rows) == ("attn", 2 if base_tp <= 2 else 1)


def test_pipeline_stages_see_their_own_layer_types():
    """OLMo 3's base model picks each layer's mask and RoPE by ``config.layer_types[i]``
    with i its position in the (stage's) layer list: a stage gets its layers' types."""
    cfg = AutoConfig.for_model("olmo3", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                               sliding_window=4, tie_word_embeddings=False,
                               layer_types=["sliding_attention", "full_attention"] * 2)
    res = hf_selftest.self_test(cfg, HfAdapter)
    assert "2 pipeline stages" in res.layouts and res.pipeline is None, res


@pytest.mark.parametrize("q_lora_rank", [16, None])
def test_minicpm3_latent_attention_by_head(q_lora_rank):
    """MiniCPM3's multi-head latent attention: a unit is a head (its q / q_b rows, its
    k-nope and v rows of kv_b, its o_proj columns); the latent projections
    (``mla_kv_a_proj``, q_a and their norms) are replicated with partial gradients; the
    plan's q_proj, left out when q_lora_rank is set, is skipped."""
    cfg = AutoConfig.for_model("minicpm3", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=4, head_dim=8, qk_rope_head_dim=8,
                               qk_nope_head_dim=4, v_head_dim=8, kv_lora_rank=16, q_lora_rank=q_lora_rank,
                               max_position_embeddings=64, tie_word_embeddings=False)
    ad = _passes(cfg, 2)
    specs = {s.name.split(".", 3)[-1]: s for s in ad.specs if ".layers.0." in s.name}
    assert specs["self_attn.kv_b_proj.weight"].unit_rows == 4 + 8
    assert specs["self_attn.kv_a_proj_with_mqa.weight"].partial_grad
    if q_lora_rank:
        assert specs["self_attn.q_a_proj.weight"].partial_grad and specs["self_attn.q_b_proj.weight"].unit_rows == 12


def test_qwen3_5_gated_query_and_gathered_linear_attention():
    """Qwen 3.5: full-attention layers with a gated query (each head's query rows then its
    gate rows: a unit's rows contiguous) and linear-attention layers whose every projection
    gathers its output (``colwise_gather_output``, out_proj included): those run replicated."""
    mini = hf_miniature.miniature_config(AutoConfig.for_model("qwen3_5_text"))
    ad = _passes(mini, 2)
    specs = {s.name: s for s in ad.specs}
    q = next(s for n, s in specs.items() if n.endswith("self_attn.q_proj.weight"))
    assert q.family == "attn" and q.unit_rows == 2 * 2 * 8  # 2 query heads per KV group, query + gate
    assert all(s.family == "_replicated" and not s.partial_grad for n, s in specs.items() if ".linear_attn." in n)


def test_gemma4_unified_per_layer_head_dims():
    """Gemma 4 (unified): a heterogeneous config whose full-attention layers have wider heads
    (``per_layer_config``): the miniature keeps the kept layers' overrides, and each
    attention block's units take its own head size."""
    mini = hf_miniature.miniature_config(AutoConfig.for_model("gemma4_unified_text"))
    ad = _passes_tp(mini, 3)
    rows = {s.name.split("layers.")[1]: s.unit_rows for s in ad.specs if s.name.endswith("k_proj.weight")}
    assert sorted(rows.values()) == [8, 16]  # one KV head's rows: 8 (sliding), 16 (full attention)


def _passes_tp(cfg, base_tp: int) -> HfAdapter:
    ad = HfAdapter(cfg, base_tp)
    assert ad.fidelity is not None and ad.fidelity.tensor_parallel is None, ad.fidelity
    return ad


@pytest.mark.parametrize("family,kw", [
    ("gpt_neox", {"intermediate_size": 48, "attention_dropout": 0.1, "hidden_dropout": 0.1}),
    ("codegen", {"n_inner": 48, "rotary_dim": 2, "attn_pdrop": 0.1, "resid_pdrop": 0.1}),
    ("minicpm3", {"intermediate_size": 48, "num_key_value_heads": 4, "head_dim": 8, "qk_rope_head_dim": 8,
                  "qk_nope_head_dim": 4, "v_head_dim": 8, "kv_lora_rank": 16, "q_lora_rank": 16,
                  "attention_dropout": 0.1}),
])
def test_dropout_in_attention_modules_found_by_the_adapter(family, kw):
    """Attention dropout keyed per query head in attention modules that are not Llama-style
    (the reference keys the modules the adapter treats as attention, ``keyed_reference``)."""
    _passes_tp(AutoConfig.for_model(family, **MHA, tie_word_embeddings=False, **kw), 2)
