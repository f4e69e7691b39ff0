"""A tensor-parallel plan derived from a decoder's module structure, for families whose
``base_model_tp_plan`` shards only the embedding (transformers 5.24: Bamba, DiffLlama,
Emu3, Falcon-H1, HunYuan dense, LFM2, ...). Such a plan would leave every member holding
and running the whole decoder: nothing for NTP to keep. Their attention and MLP blocks
are mostly Llama-shaped, so tpflex writes the plan HF's DTensor TP would need, from the
structure of the model (not from a list of family names):

* an attention module (``hf_plan.is_attention``): its query, key and value projections
  are column-parallel, its output projection row-parallel, a gate on the heads' outputs
  (as wide as the output projection's input, or one per head: LFM3's ``g_proj``)
  column-parallel, and a norm over one head
  (weight of ``head_dim`` elements: Qwen 3-style q/k norms) replicated with partial
  gradients;
* an MLP: a child whose only parameters are in linears from the hidden size to one
  width (column-parallel) and exactly one linear back (row-parallel);
* anything else (Mamba mixers, short convolutions, norms) is not planned: replicated,
  HF's module run whole on every member on the same inputs.

Nothing here is trusted on its own: the fidelity self-test (``hf_selftest``) runs the
derived plan against HF's module on a miniature of the user's config and refuses the
model if any gradient differs (DiffLlama's paired heads, for example). A decoder layer
with expert parameters (a 3-D weight, a child called ``experts``) is mixture-of-experts
and refused as such."""

from __future__ import annotations

from torch import nn

from tpflex_trainer.ntp.errors import UnsupportedModelError

# the words of every mixture-of-experts refusal (by plan style, or experts found in the modules)
MOE_REFUSAL = "a mixture-of-experts model"
QUERY_KEY_VALUE = ("q_proj", "k_proj", "v_proj", "query", "key", "value")
OUTPUT = ("o_proj", "out_proj", "dense", "o")
DERIVED = "derived from the module structure (its tp plan shards only the embedding)"


def decoder_layers(base: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The base model's decoder-layer list: ``layers`` or its only ``nn.ModuleList`` child."""
    lists = [(n, m) for n, m in base.named_children() if isinstance(m, nn.ModuleList) and len(m)]
    named = [x for x in lists if x[0] == "layers"]
    if named:
        return named[0]
    return lists[0] if len(lists) == 1 else None


def _linears(module: nn.Module) -> dict[str, nn.Linear]:
    return {n: c for n, c in module.named_children() if isinstance(c, nn.Linear)}


def _attention_entries(path: str, attn: nn.Module, head_dim: int) -> dict[str, str]:
    linears = _linears(attn)
    qkv = [n for n in QUERY_KEY_VALUE if n in linears]
    out = [n for n in OUTPUT if n in linears]
    if len(qkv) != 3 or len(out) != 1:
        return {}
    plan = {f"{path}.{n}": "colwise" for n in qkv}
    plan[f"{path}.{out[0]}"] = "rowwise"
    width = linears[out[0]].in_features
    for n, lin in linears.items():
        if n not in qkv and n != out[0] and lin.out_features in (width, width // head_dim):
            plan[f"{path}.{n}"] = "colwise"  # a gate on the heads' outputs, per element or per head
    for n, child in attn.named_children():
        params = dict(child.named_parameters())
        if list(params) == ["weight"] and params["weight"].dim() == 1 and params["weight"].numel() == head_dim:
            plan[f"{path}.{n}"] = "replicated_with_grad_allreduce"  # a per-head norm: partial gradients
    return plan


def _mlp_entries(path: str, mlp: nn.Module, hidden: int) -> dict[str, str]:
    linears = _linears(mlp)
    if not linears or sum(p.numel() for p in mlp.parameters()) != sum(
            p.numel() for lin in linears.values() for p in lin.parameters()):
        return {}  # parameters outside the linears (or none): not an MLP this knows
    down = [n for n, lin in linears.items() if lin.out_features == hidden and lin.in_features != hidden]
    if len(down) != 1:
        return {}
    width = linears[down[0]].in_features
    up = [n for n, lin in linears.items() if n != down[0]]
    if not up or any(linears[n].in_features != hidden or linears[n].out_features % width for n in up):
        return {}
    plan = {f"{path}.{n}": "colwise" for n in up}
    plan[f"{path}.{down[0]}"] = "rowwise"
    return plan


def _packed(module: nn.Module) -> bool:
    """Weights of more than 2 dimensions outside a convolution: packed experts."""
    return any(p.dim() > 2 for m in module.modules() if not isinstance(m, nn.modules.conv._ConvNd)
               for p in m.parameters(recurse=False))


def derive(base: nn.Module, config, head_dim: int, is_attention) -> dict[str, str]:
    """Plan entries (``layers.*.self_attn.q_proj: colwise``, ...) keyed like a
    ``base_model_tp_plan``; empty when the decoder has nothing this can shard.
    ``UnsupportedModelError`` for a decoder layer with experts."""
    found = decoder_layers(base)
    if found is None:
        return {}
    name, layers = found
    hidden = int(config.hidden_size)
    plan: dict[str, str] = {}
    for layer in layers:
        for child_name, child in layer.named_children():
            if any(n.split(".")[-1] == "experts" for n, _ in child.named_modules()) or _packed(child):
                raise UnsupportedModelError(f"{type(config).__name__}: {MOE_REFUSAL} ({name}.*."
                                            f"{child_name} holds experts): expert layers are not supported "
                                            "under NTP yet")
            path = f"{name}.*.{child_name}"
            entries = (_attention_entries(path, child, head_dim) if is_attention(child)
                       else _mlp_entries(path, child, hidden))
            plan.update(entries)
    return plan
