"""Families whose ``base_model_tp_plan`` shards only the embedding (Bamba, Emu3, Falcon-H1,
HunYuan dense, LFM2/3, ...): tpflex derives a plan from the decoder's modules
(``hf_derived_plan``), and the fidelity self-test decides whether it is exact. The
derivation is checked against HF's own plan where HF has one (Llama's), a decoder with
experts is refused as mixture-of-experts, one with nothing to shard keeps the refusal,
and a derived plan that is not exact (DiffLlama's paired heads) is refused by the
self-test. The miniatures of configs that validate their own sizes (Mamba mixers, Dory's
recurrent depth) are consistent and small."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from tpflex_trainer.ntp import hf_coverage, hf_derived_plan, hf_miniature, hf_plan, hf_selftest
from tpflex_trainer.ntp.errors import UnsupportedModelError
from tpflex_trainer.ntp.hf_adapter import HfAdapter, build_meta_model
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=64)


def test_a_derived_plan_for_llama_equals_hfs_own_plan():
    """Llama's modules with its plan cut to the embedding: the derived plan gives the roles,
    blocks and specs HF's own plan gives (q/k/v columns, o_proj rows, gate/up columns,
    down rows)."""
    own = AutoConfig.for_model("llama", **LLAMA)
    cut = AutoConfig.for_model("llama", **LLAMA)
    cut.base_model_tp_plan = {"embed_tokens": "embedding_rowwise"}
    for base_tp in (2, 5):  # KV-group units, and query-head units above the 4 KV heads
        want = hf_plan.analyse(build_meta_model(own), own, base_tp)
        got = hf_plan.analyse(build_meta_model(cut), cut, base_tp)
        assert (want.source, got.source) == ("hf", "derived")
        assert got.roles == want.roles and got.blocks == want.blocks
        assert got.specs == want.specs and got.unit_counts == want.unit_counts


def test_per_head_q_k_norms_get_partial_gradients():
    """Qwen 3's q_norm / k_norm (one head's width) with the plan cut: replicated with partial
    gradients, as HF's plan says (``replicated_with_grad_allreduce``)."""
    cfg = AutoConfig.for_model("qwen3", **LLAMA)
    cut = AutoConfig.for_model("qwen3", **LLAMA)
    cut.base_model_tp_plan = {"embed_tokens": "embedding_rowwise"}
    want = hf_plan.analyse(build_meta_model(cfg), cfg, 2)
    got = hf_plan.analyse(build_meta_model(cut), cut, 2)
    assert [s for s in got.specs if s.partial_grad] == [s for s in want.specs if s.partial_grad] != []
    assert got.roles == want.roles


class _Layer(nn.Module):
    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.mixer = child


class _Base(nn.Module):
    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(child)])


def test_experts_are_refused_as_mixture_of_experts_and_a_conv_is_not_planned():
    cfg = AutoConfig.for_model("llama", **LLAMA)
    packed = nn.Module()
    packed.experts = nn.Module()
    packed.experts.gate_up_proj = nn.Parameter(torch.zeros(4, 32, 96))
    with pytest.raises(UnsupportedModelError, match="a mixture-of-experts model .*experts"):
        hf_derived_plan.derive(_Base(packed), cfg, 4, hf_plan._is_attention)
    # a short convolution (3-D weight, not experts) and a norm: nothing to shard, no refusal
    conv = nn.Sequential(nn.Conv1d(32, 32, 3, groups=32), nn.LayerNorm(32))
    assert hf_derived_plan.derive(_Base(conv), cfg, 4, hf_plan._is_attention) == {}


def test_gpt_oss_is_refused_as_mixture_of_experts():
    with pytest.raises(UnsupportedModelError, match="a mixture-of-experts model"):
        HfAdapter(hf_miniature.miniature_config(AutoConfig.for_model("gpt_oss")), 2)


def test_a_derived_plan_that_is_not_exact_is_refused_by_the_self_test():
    """DiffLlama's differential attention pairs heads across the head axis: sharded by KV
    groups it cannot run as HF's module does, so the self-test refuses it, naming the test."""
    with pytest.raises(UnsupportedModelError, match="failed the fidelity self-test"):
        HfAdapter(hf_miniature.miniature_config(AutoConfig.for_model("diffllama")), 2)


@pytest.mark.parametrize("family,kw", [("emu3", {}), ("hunyuan_v1_dense", {}), ("lfm2", {}), ("lfm3", {}),
                                       ("falcon_h1", {}), ("bamba", {"attn_layer_indices": [1, 3]})])
def test_derived_plan_families_pass_the_self_test(family, kw):
    """Each with attention and an MLP in its miniature (Bamba's default has no attention
    layer: two of its four are attention layers here, and the miniature keeps one)."""
    cfg = hf_coverage._causal_lm_config(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family], AutoConfig.for_model(family, **kw))
    ad = HfAdapter(hf_miniature.miniature_config(cfg), 2)
    assert ad.plan.source == "derived"
    assert ad.fidelity is not None and ad.fidelity.tensor_parallel is None, ad.fidelity
    assert set(ad.plan.blocks.values()) == {hf_plan.ATTN, hf_plan.FFN}


@pytest.mark.parametrize("family", ["bamba", "falcon_h1"])
def test_a_mamba_miniature_is_consistent_and_small(family):
    cfg = AutoConfig.for_model(family)
    mini = hf_miniature.miniature_config(cfg)
    inner = mini.mamba_expand * mini.hidden_size
    assert mini.mamba_n_heads * mini.mamba_d_head == inner
    assert mini.mamba_d_state < cfg.mamba_d_state and mini.mamba_chunk_size < hf_miniature.SEQ
    model = build_meta_model(mini)
    assert sum(p.numel() for p in model.parameters()) < hf_selftest.MAX_MINIATURE_PARAMS // 10


def test_a_recurrent_depth_miniature_adds_up():
    """Dory stores each layer's type followed by "mlp" and twice the layer counts: the
    miniature keeps an input, a recurrent and an output layer, in that stored form."""
    mini = hf_miniature.miniature_config(AutoConfig.for_model("dory"))
    assert mini.n_input_layers + mini.n_recurrent_layers + mini.n_output_layers == mini.num_hidden_layers == 3
    assert len(mini.layer_types) == 3


def test_a_hybrid_miniature_keeps_an_attention_layer_by_index():
    mini = hf_miniature.miniature_config(AutoConfig.for_model("bamba", attn_layer_indices=[9, 18, 27]))
    assert mini.num_hidden_layers == 2 and mini.attn_layer_indices == [1]  # layers 0 (Mamba) and 9
