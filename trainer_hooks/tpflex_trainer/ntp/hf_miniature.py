"""The fidelity self-test's miniature of a user's config (``miniature_config``): the same
class and every field that is not a size, tiny sizes. Families whose config validates its
own sizes get them shrunk consistently: Mamba mixers (Bamba, Falcon-H1: heads x head size
= expand x hidden, a small state and chunk) and recurrent-depth decoders (Dory: input,
recurrent and output layers adding up to the layers kept). A hybrid that lists its
attention layers by index (Bamba's ``attn_layer_indices``) keeps one of them, re-indexed."""

from __future__ import annotations

import copy

from tpflex_trainer.ntp.hf_plan import attention_heads, config_value

VOCAB, HIDDEN_PER_HEAD, FFN, SEQ, BATCH, LAYERS = 96, 8, 48, 12, 3, 2
MAMBA_HEAD, MAMBA_STATE = 8, 8
ATTENTION_INDICES = "attn_layer_indices"
RECURRENT_DEPTH = ("n_input_layers", "n_recurrent_layers", "n_output_layers")
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings")
TOKEN_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")
# a sub-config of another modality inside the causal LM's config (Phi-4-multimodal's vision
# and audio encoders, which its causal LM builds): shrunk as well, so the miniature is small;
# their parameters are replicated and take no part in a text forward
SUB_SIZES = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_blocks": 1,
             "num_attention_heads": 2, "num_key_value_heads": 2}
# multi-head latent attention (DeepSeek-style, Youtu): its low ranks and head parts, shrunk
# where the config sets them (a None rank keeps its meaning: no low-rank query)
MLA_SIZES = {"kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": HIDDEN_PER_HEAD, "qk_nope_head_dim": 4,
             "v_head_dim": HIDDEN_PER_HEAD, "qk_head_dim": HIDDEN_PER_HEAD + 4}



def _pick_layers(n: int, types: list | None, at_least: int = LAYERS) -> list[int]:
    """Indices of the layers the miniature keeps: the first of each distinct layer type (in
    order), then the next layers, up to ``LAYERS`` (at least)."""
    keep: list[int] = []
    if types:
        seen = set()
        for i, t in enumerate(types[:n]):
            if repr(t) not in seen:
                seen.add(repr(t))
                keep.append(i)
    for i in range(n):
        if len(keep) >= at_least:
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep)


def _small_sub(field: str, value):
    if not isinstance(value, int) or isinstance(value, bool):
        return value
    if field in SUB_SIZES:
        return SUB_SIZES[field]
    return 16 if "channel" in field else value


def miniature_config(config, kv_heads: int = 4):
    """The user's config with tiny sizes: ``kv_heads`` KV heads (fewer if it has fewer;
    query heads per KV head up to 2, as in the model), head dim 8, 48 FFN columns, a
    96-token vocabulary, 2 layers (one of each layer type), and every per-layer list cut to
    the layers kept. Token ids (pad, bos, eos) are kept when inside the vocabulary, else
    moved to its last ids (the padding row keeps its meaning). Everything else is the
    user's."""
    n_heads, n_kv = attention_heads(config)
    kv = min(n_kv, kv_heads)
    heads = kv * min(n_heads // n_kv, 2)
    d = config.to_dict()
    names = {v: k for k, v in getattr(type(config), "attribute_map", {}).items()}  # standard -> stored

    def key(std: str) -> str:
        return std if std in d else names.get(std, std)

    n_layers = int(config.num_hidden_layers)
    # a config whose stored form lists r entries per layer (Dory stores each layer's type
    # followed by "mlp", and twice the layer counts, halving them again when loaded)
    stored = d.get(key("num_hidden_layers"))
    r = stored // n_layers if _is_int(stored) and n_layers and stored % n_layers == 0 else 1
    types = config_value(config, "layer_types")
    types = types if isinstance(types, list) else d.get("layer_types")
    indices = d.get(ATTENTION_INDICES)  # a hybrid's attention layers by index (Bamba), the rest Mamba
    if isinstance(indices, list) and all(_is_int(i) for i in indices):
        types = ["attention" if i in indices else "mamba" for i in range(n_layers)]
    depth = all(_is_int(d.get(f)) for f in RECURRENT_DEPTH)  # input, recurrent, output: 3 at least
    keep = _pick_layers(n_layers, types, 3 if depth else LAYERS)
    if isinstance(indices, list) and all(_is_int(i) for i in indices):
        d[ATTENTION_INDICES] = [j for j, i in enumerate(keep) if i in indices]
    sizes = {key(f) for f in SIZE_FIELDS}
    for k, value in list(d.items()):
        if isinstance(value, list) and len(value) == n_layers * r and k not in sizes:
            d[k] = [value[r * i + j] for i in keep for j in range(r)]
    small = dict(vocab_size=VOCAB, hidden_size=heads * HIDDEN_PER_HEAD, intermediate_size=FFN,
                 num_hidden_layers=len(keep) * r, num_attention_heads=heads, num_key_value_heads=kv,
                 max_position_embeddings=64)
    if "head_dim" in d or config_value(config, "head_dim") is not None:
        small["head_dim"] = HIDDEN_PER_HEAD  # also where the config leaves it None (Ministral's default)
    rotary = d.get("rotary_dim")
    if isinstance(rotary, int) and not isinstance(rotary, bool) and rotary > 0:
        # GPT-J / CodeGen rotate the first rotary_dim of each head: the same fraction of the
        # miniature's head (at least one pair, partial where the model's is partial)
        full = int(config.hidden_size) // n_heads
        frac = min(rotary / full, 1.0) if full else 1.0
        small["rotary_dim"] = HIDDEN_PER_HEAD if frac >= 1 else min(max(2, 2 * round(frac * HIDDEN_PER_HEAD / 2)),
                                                                     HIDDEN_PER_HEAD - 2)
    for k, value in MLA_SIZES.items():
        if _is_int(d.get(k)):
            small[k] = value
    small.update(_mamba_sizes(d, small["hidden_size"]))
    small.update(_recurrent_depth(d, len(keep), r))
    for std, value in small.items():
        d[key(std)] = value
    for sub in getattr(type(config), "sub_configs", {}) or {}:
        if isinstance(d.get(sub), dict):
            d[sub] = {k: _small_sub(k, v) for k, v in d[sub].items()}
    for i, k in enumerate(TOKEN_FIELDS):
        value = d.get(k)
        if isinstance(value, int) and not 0 <= value < VOCAB:
            d[k] = VOCAB - 1 - i
        elif isinstance(value, list):
            d[k] = [v if 0 <= v < VOCAB else VOCAB - 1 - i for v in value]
    if isinstance(d.get("sliding_window"), int) and d["sliding_window"] > 0:
        d["sliding_window"] = min(d["sliding_window"], SEQ // 2)  # the window is reached
    per_layer = d.get("per_layer_config")
    if isinstance(per_layer, dict) and per_layer:
        # a heterogeneous config (Gemma 4: wider heads on its full-attention layers): the kept
        # layers' overrides, re-indexed, their head dims scaled like the global one
        full_hd = getattr(config, "__dict__", {}).get("head_dim")
        over = {int(i): dict(v) for i, v in per_layer.items() if isinstance(v, dict)}
        new = {}
        for j, i in enumerate(keep):
            if i in over:
                o = over[i]
                if isinstance(o.get("head_dim"), int) and isinstance(full_hd, int) and full_hd > 0:
                    o["head_dim"] = max(2, o["head_dim"] * HIDDEN_PER_HEAD // full_hd)
                new[j] = o
        d["per_layer_config"] = new
    for k in ("dtype", "torch_dtype", "base_model_tp_plan", "base_model_pp_plan"):
        d.pop(k, None)
    mini = type(config).from_dict(d)
    impl = getattr(config, "_attn_implementation_internal", None)
    if impl:
        mini._attn_implementation = impl
    mini.base_model_tp_plan = copy.deepcopy(config.base_model_tp_plan)
    return mini


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _mamba_sizes(d: dict, hidden: int) -> dict:
    """A Mamba-2 mixer's sizes for the miniature (where the config has them): heads of
    ``MAMBA_HEAD`` channels filling ``mamba_expand`` x hidden (its ``mamba_d_ssm`` where set),
    a small state, a chunk shorter than the sequence (the chunked scan runs more than once)."""
    if not _is_int(d.get("mamba_n_heads")):
        return {}
    expand = d.get("mamba_expand") if _is_int(d.get("mamba_expand")) and d["mamba_expand"] > 0 else 2
    inner = expand * hidden
    out = {"mamba_n_heads": inner // MAMBA_HEAD, "mamba_d_head": MAMBA_HEAD, "mamba_d_state": MAMBA_STATE,
           "mamba_chunk_size": SEQ // 3, "mamba_n_groups": 1}
    if "mamba_d_ssm" in d and d["mamba_d_ssm"] is not None:
        out["mamba_d_ssm"] = inner
    return {k: v for k, v in out.items() if k in d}


def _recurrent_depth(d: dict, layers: int, r: int) -> dict:
    """A recurrent-depth decoder's split of its layers (Dory: input, recurrent and output
    layers adding up to ``num_hidden_layers``): one input and one output layer, the rest
    recurrent (each times ``r``, as the config stores them)."""
    if not all(_is_int(d.get(f)) for f in RECURRENT_DEPTH) or layers < 3:
        return {}
    return {"n_input_layers": r, "n_recurrent_layers": (layers - 2) * r, "n_output_layers": r}
