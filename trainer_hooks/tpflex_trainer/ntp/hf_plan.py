"""From a Hugging Face causal LM (built on the meta device) and its
``config.base_model_tp_plan`` to the runtime's parameter specs: which parameters are
units of which family, how many units each family has, and what every planned module
becomes. No collectives, no weights.

* A block's planned linears are grouped by their parent module: colwise + one rowwise
  partner. In an attention module (it has ``head_dim``) the unit is a KV group with its
  query heads (q rows, k and v rows, o_proj columns) when the job's base TP degree is at
  most the KV-group count; above it the unit is one query head and the KV heads form the
  derived family ``kv`` (a KV head is held by every member holding one of its query
  heads, see ``layout.Derived``). In any other block (the MLP) the unit is a block of
  columns of the intermediate size.
* ``replicated_with_grad_allreduce`` modules (Qwen3's per-head q_norm/k_norm) are
  replicated with partial gradients; unplanned parameters (norms) are replicated.
* The embedding and the (possibly tied) output layer are vocab-parallel: units are
  blocks of vocab rows. A plan entry for the embedding itself (``embed_tokens:
  embedding_rowwise``, as some transformers 5.x releases give Qwen3) is accepted and
  superseded by that vocab-parallel embedding: both shard the table by vocab rows.
Anything else is refused with ``UnsupportedModelError`` naming the module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from tpflex_trainer.ntp import hf_derived_plan
from tpflex_trainer.ntp.config import REPLICATED, ParamSpec
from tpflex_trainer.ntp.errors import LayoutError, UnsupportedModelError
from tpflex_trainer.ntp.hf_derived_plan import MOE_REFUSAL
from tpflex_trainer.ntp.layout import Derived

STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce", "colwise_gather_output", "rowwise_split_input",
          "local_params", "mla_kv_a_proj")
# multi-head latent attention's shared latent projection (MiniCPM3's kv_a_proj_with_mqa): it
# feeds every head, so each member holds it whole and its gradient is partial, summed over
# the TP group (as ``replicated_with_grad_allreduce``)
MLA_KV_A = "mla_kv_a_proj"
# HF's marker that a module's parameters stay plain local tensors under its DTensor TP
# (Granite-SWA's attention, for its per-head sinks): nothing to do under NTP
LOCAL_PARAMS = "local_params"
# HF gathers a colwise_gather_output projection's output and splits a rowwise_split_input
# one's input again; tpflex keeps both sharded (column / row units) and lets the fidelity
# self-test decide whether what runs between them is exact on the member's columns
COLUMN_STYLES = ("colwise", "colwise_gather_output")
ROW_STYLES = ("rowwise", "rowwise_split_input")
# plan styles for the embedding table that tpflex's own vocab-parallel embedding supersedes
EMBEDDING_STYLES = ("embedding_rowwise", "rowwise")
# plan styles of expert layers (the MoE issue): such a model is refused as mixture-of-experts
MOE_STYLES = ("moe_tp_experts", "packed_colwise", "packed_rowwise", "moe_identity_expert")
ATTN, KV, FFN, VOCAB = "attn", "kv", "ffn", "vocab"


@dataclass(frozen=True)
class Role:
    """What a planned module becomes: ``kind`` is column / row / kv (a column-parallel
    K or V projection whose rows are shared KV units) / partial (replicated, partial
    gradient) / norm (an RMSNorm over a whole column projection, OLMo 2's q_norm: a
    distributed norm, weight sharded like the projection)."""

    kind: str
    family: str
    # a fused column projection: its number of equal chunks (GLM's gate_up_proj: 2), or its
    # rows per unit of each chunk (Phi-3's qkv_proj: query heads x head_dim, head_dim,
    # head_dim per KV group)
    fused: int = 1
    chunk_rows: tuple[int, ...] = ()
    per_head: int = 0  # an attention column projection's rows per query head, where not head_dim


@dataclass(frozen=True)
class HfPlan:
    specs: list[ParamSpec]
    unit_counts: dict[str, int]
    derived: dict[str, Derived]
    roles: dict[str, Role]  # module path -> role
    blocks: dict[str, str]  # parent module path -> "attn" | "ffn" (copy-to-TP at its input)
    head_units: bool  # attention units are single query heads (KV heads replicated)
    n_heads: int
    n_kv: int
    head_dim: int
    vocab_block: int
    tied: bool
    prefix: str = "model"  # the base model's attribute (``base_model_prefix``)
    # the model's own names: the base model's embedding, decoder-layer list and final norm
    # (None: none found, so no pipeline stages), and the causal LM's output layer
    embed: str = "embed_tokens"
    layers: str | None = "layers"
    norm: str | None = "norm"
    head: str = "lm_head"
    # attention modules whose head count the model reads from attributes it sets itself:
    # CodeGen's ``mp_num`` blocks of its fused q/v/k (a unit is one such block)
    mp_blocks: bool = False
    # per-head parameters of attention modules that the plan shards (Granite-SWA's sinks):
    # sharded with the attention units, one entry per query head
    head_params: frozenset = frozenset()
    # "hf": the config's base_model_tp_plan; "derived": tpflex's, from the module structure
    # (``hf_derived_plan``: the config's plan shards only the embedding)
    source: str = "hf"


def check_base_tp(base_tp: int) -> None:
    """The job's base TP degree must be at least 1 (``LayoutError`` ``degree_zero``, as
    ``layout.validate_request`` says for any model)."""
    if base_tp < 1:
        raise LayoutError(f"base_tp must be >= 1, got {base_tp}", code="degree_zero")


def attention_heads(config) -> tuple[int, int]:
    """(query heads, KV heads) of ``config``; no ``num_key_value_heads`` means one KV head
    per query head. ``UnsupportedModelError`` unless the query heads are a positive
    multiple of the KV heads: an attention unit is a KV group with its query heads, and a
    remainder would leave heads out of every unit (HF's own attention refuses such a
    config in its forward, or divides by zero building it)."""
    n_heads = int(config.num_attention_heads)
    kv = getattr(config, "num_key_value_heads", None)
    n_kv = n_heads if kv is None else int(kv)
    if n_heads < 1 or n_kv < 1 or n_heads % n_kv:
        raise UnsupportedModelError(f"{type(config).__name__}: num_attention_heads {n_heads} is not a "
                                    f"positive multiple of num_key_value_heads {n_kv}")
    return n_heads, n_kv


KEYED_ATTENTION = (None, "eager", "sdpa")


def check_dropout(model: nn.Module, config) -> None:
    """Dropout trains under NTP with masks keyed by sample, module and unit (``dropout``),
    drawn through ``torch.nn.functional.dropout`` or, for sdpa attention, in the math
    form; an attention kernel that draws its own mask (flash, flex) with attention dropout
    above 0 is refused, naming the construct."""
    impl = getattr(getattr(model, "config", config), "_attn_implementation", None)
    if impl in KEYED_ATTENTION:
        return
    for name, module in model.named_modules():
        p = getattr(module, "attention_dropout", 0.0)
        if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0:
            raise UnsupportedModelError(f"{name}: attention dropout {p} with attn_implementation {impl!r}: the "
                                        "kernel draws its own mask, which cannot be made the same for a query "
                                        "head whichever TP member holds it (use eager or sdpa attention, or set "
                                        "attention_dropout to 0.0)")


def choose_units(n: int, base_tp: int) -> int:
    """Units of a family of ``n`` rows: the smallest divisor of n that is at least
    4·base_tp (a balanced spread over any degree up to base_tp), else n."""
    check_base_tp(base_tp)
    target = 4 * base_tp
    for d in range(target, n + 1):
        if n % d == 0:
            return d
    return n


def _compile(plan: dict[str, str], prefix: str) -> list[tuple[re.Pattern, str, str]]:
    out = []
    for key, style in plan.items():
        if style not in STYLES:
            raise UnsupportedModelError(f"tp plan style {style!r} of {key!r} is not supported "
                                        f"(supported: {', '.join(STYLES)})")
        pattern = re.escape(f"{prefix}.{key}" if prefix else key).replace(r"\*", r"\d+")
        out.append((re.compile(pattern + r"$"), style, key))
    return out


def _planned_modules(model: nn.Module, plan, prefix: str) -> tuple[dict[str, str], dict[str, str]]:
    """(planned modules, planned parameters: an entry naming a parameter, Granite-SWA's
    per-head ``self_attn.sinks``), each path -> style."""
    rules = _compile(plan, prefix)
    found: dict[str, str] = {}
    params: dict[str, str] = {}
    matched = set()
    for name, _ in model.named_modules():
        for pattern, style, key in rules:
            if pattern.match(name):
                found[name] = style
                matched.add(key)
    by_param = set()
    for name, _ in model.named_parameters():
        for pattern, style, key in rules:
            if key not in matched and pattern.match(name):
                params[name] = style
                by_param.add(key)
    matched |= by_param
    missing = [k for _, _, k in rules if k not in matched and not _configured_away(model, k, prefix)]
    if missing:
        raise UnsupportedModelError(f"tp plan entries {missing} match no module of the model")
    return found, params


def _configured_away(model: nn.Module, key: str, prefix: str) -> bool:
    """A plan entry whose module the config left out: its parent modules exist and hold
    None there (MiniCPM3's ``q_proj`` when ``q_lora_rank`` is set: q_a_proj / q_b_proj)."""
    if "." not in key:
        return False
    parent_key, leaf = key.rsplit(".", 1)
    pattern = re.compile(re.escape(f"{prefix}.{parent_key}" if prefix else parent_key).replace(r"\*", r"\d+") + "$")
    parents = [m for n, m in model.named_modules() if pattern.match(n)]
    return bool(parents) and all(leaf in vars(m) and getattr(m, leaf) is None for m in parents)


def check_experts(config) -> None:
    """``UnsupportedModelError`` for a mixture-of-experts plan (expert plan styles)."""
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    experts = sorted({f"{k}: {v}" for k, v in plan.items() if v in MOE_STYLES})
    if experts:
        raise UnsupportedModelError(f"{type(config).__name__}: {MOE_REFUSAL} (tp plan {experts[:2]}): "
                                    "expert layers are not supported under NTP yet")


def _embedding_only(config) -> None:
    raise UnsupportedModelError(f"{type(config).__name__}: its tp plan shards only the embedding, so every "
                                "member would hold and run the whole decoder, and tpflex found no attention or "
                                "MLP block to shard in it: no tensor parallelism for NTP to keep (train it "
                                "data-parallel)")


def check_plan(config) -> None:
    """What the config alone refuses, before any model is built: a mixture-of-experts plan.
    A plan that shards only the embedding is left to the adapter, which derives one from
    the decoder's modules (``hf_derived_plan``) or refuses the model."""
    check_experts(config)


def config_value(config, name: str):
    """``config.<name>``, None where it is missing or a per-layer attribute of a
    heterogeneous config (transformers raises for a global read of those)."""
    try:
        return getattr(config, name, None)
    except RuntimeError:
        return None


def analyse(model: nn.Module, config, base_tp: int) -> HfPlan:
    """The plan for a causal LM ``model`` (parameters may be on the meta device)."""
    check_base_tp(base_tp)
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not plan:
        raise UnsupportedModelError(f"{type(config).__name__} has no base_model_tp_plan")
    check_experts(config)
    prefix = getattr(model, "base_model_prefix", "model")
    base = getattr(model, prefix, None)
    if base is None and prefix != "model":
        prefix, base = "model", getattr(model, "model", None)  # Llama 4's text model: prefix language_model
    if base is None:
        raise UnsupportedModelError(f"{type(model).__name__}: no base model at {prefix!r}")
    embed_name, embed = _child_named(base, _try(base.get_input_embeddings))
    if not isinstance(embed, nn.Embedding) or [n for n, _ in embed.named_parameters()] != ["weight"]:
        raise UnsupportedModelError(f"{type(model).__name__}: {prefix}.{embed_name or 'embed_tokens'} is not an "
                                    "nn.Embedding (or a subclass) whose only parameter is its weight")
    head_name, head = _child_named(model, _try(model.get_output_embeddings))
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        raise UnsupportedModelError(f"{type(model).__name__}: the output layer ({head_name or 'lm_head'}) must be "
                                    "a plain Linear")
    check_dropout(model, config)
    if embed_name in plan:
        if plan[embed_name] not in EMBEDDING_STYLES:
            raise UnsupportedModelError(f"tp plan style {plan[embed_name]!r} of {embed_name!r} is not "
                                        f"supported (supported: {', '.join(EMBEDDING_STYLES)})")
        del plan[embed_name]  # vocab-parallel below, whatever the plan says
    source = "hf"
    if not plan:
        n_heads, _ = attention_heads(config)
        plan = hf_derived_plan.derive(base, config, int(config_value(config, "head_dim")
                                                         or config.hidden_size // n_heads), _is_attention)
        if not plan:
            _embedding_only(config)
        source = "derived"
    layers_name = _layer_list(base, plan)
    norm_name = _final_norm(base, {embed_name, layers_name}) if layers_name else None
    plan = {k: v for k, v in plan.items() if v != LOCAL_PARAMS}
    planned, planned_params = _planned_modules(model, plan, prefix)
    modules = dict(model.named_modules())
    n_heads, n_kv = attention_heads(config)
    head_dim = int(config_value(config, "head_dim") or config.hidden_size // n_heads)
    attn_parents = {name.rsplit(".", 1)[0] for name in planned if _is_attention(modules[name.rsplit(".", 1)[0]])}
    mp = {getattr(modules[a], "mp_num", None) for a in attn_parents}
    mp_blocks = any(v is not None for v in mp)
    if mp_blocks:
        # CodeGen: its fused qkv_proj is ``mp_num`` blocks of [q | v | k] rows of
        # n_heads / mp_num heads each, split by the module's own mp_num and embed_dim: a unit is
        # one block (the module gets the member's block count, ``local_attention_blocks``)
        blocks_n = next(iter(mp)) if len(mp) == 1 else None
        if isinstance(blocks_n, int) and blocks_n >= 1 and n_heads == n_kv and n_heads % blocks_n == 0:
            n_kv = blocks_n  # attention units: groups of n_heads / mp_num heads
        elif base_tp == 1:
            n_kv, mp_blocks = 1, False  # one member holds every head: one unit, HF's module as it is
        else:
            raise UnsupportedModelError(f"attention of {n_heads} heads ({n_kv} KV heads) in mp_num "
                                        f"{sorted(map(str, mp))} blocks: a unit must be a whole block of heads "
                                        "(multi-head attention, the heads a multiple of mp_num)")
    head_units = base_tp > n_kv
    if head_units and mp_blocks:
        raise UnsupportedModelError(f"base TP {base_tp} above the {n_kv} mp_num blocks of the fused q/v/k "
                                    "projection: a unit is a whole block")
    parents: dict[str, dict[str, list[str]]] = {}
    mla: set[str] = set()  # multi-head latent attention blocks
    for name, style in planned.items():
        if style != "replicated_with_grad_allreduce" and not isinstance(modules[name], nn.Linear):
            raise UnsupportedModelError(f"planned module {name} ({style}) is not a Linear")
        parent = name.rsplit(".", 1)[0]
        if style == MLA_KV_A:
            mla.add(parent)
            style = "replicated_with_grad_allreduce"
        kind = "colwise" if style in COLUMN_STYLES else "rowwise" if style in ROW_STYLES else style
        parents.setdefault(parent, {}).setdefault(kind, []).append(name)
    gathered = {p for p, by_style in parents.items() if set(by_style) == {"colwise"}
                and all(planned[n] == "colwise_gather_output" for n in by_style["colwise"])}
    for parent in gathered:
        # every projection of the block gathers its output (Qwen 3.5's linear attention,
        # out_proj included): the block computes whole outputs on every member, so it runs
        # replicated (HF's module as it is, identical gradients), no units
        del parents[parent]
    roles, blocks = {}, {}
    for parent, by_style in parents.items():
        attn = parent in attn_parents or parent in mla
        if parent in mla:
            roles.update(_mla_roles(parent, by_style, modules, head_units, n_heads, n_kv))
        else:
            # a block's own head size where it has one (Gemma 4's wider full-attention heads)
            hd = getattr(modules[parent], "head_dim", None)
            hd = hd if isinstance(hd, int) and not isinstance(hd, bool) and hd > 0 else head_dim
            roles.update(_block_roles(parent, by_style, modules, attn, head_units, n_heads, n_kv, hd))
        blocks[parent] = ATTN if attn else FFN
    ffn_sizes = {modules[n].in_features for n, r in roles.items() if r.family == FFN and r.kind == "row"}
    if len(ffn_sizes) > 1:
        raise UnsupportedModelError(f"MLP blocks of different sizes {sorted(ffn_sizes)}")
    head_params = set()
    for name, style in planned_params.items():
        shape = tuple(dict(model.named_parameters())[name].shape)
        if style not in COLUMN_STYLES or name.rsplit(".", 1)[0] not in attn_parents or shape != (n_heads,):
            raise UnsupportedModelError(f"planned parameter {name} ({style}, shape {shape}): only a per-head "
                                        "vector of an attention module, column-parallel, is supported")
        head_params.add(name)  # Granite-SWA's sinks: sharded with the module's query heads
    vocab = int(config.vocab_size)
    counts = {ATTN: n_heads if head_units else n_kv, VOCAB: choose_units(vocab, base_tp)}
    if ffn_sizes:
        counts[FFN] = choose_units(ffn_sizes.pop(), base_tp)
    tied = head.weight is embed.weight
    specs = _specs(model, roles, blocks, (f"{prefix}.{embed_name}", head_name), counts, n_heads, n_kv, head_dim,
                   head_units, config, head_params, mla)
    derived = {KV: Derived(ATTN, n_heads // n_kv)} if head_units else {}
    return HfPlan(specs, counts, derived, roles, blocks, head_units, n_heads, n_kv, head_dim,
                  vocab // counts[VOCAB], tied, prefix, embed_name, layers_name, norm_name, head_name, mp_blocks,
                  frozenset(head_params), source)


def _try(fn):
    try:
        return fn()
    except (AttributeError, NotImplementedError):
        return None


def _child_named(parent: nn.Module, module: nn.Module | None) -> tuple[str | None, nn.Module | None]:
    """(attribute name, module) of ``module`` among ``parent``'s direct children."""
    if module is None:
        return None, None
    for name, child in parent.named_children():
        if child is module:
            return name, module
    return None, module


def _layer_list(base: nn.Module, plan: dict[str, str]) -> str | None:
    """The base model's decoder-layer list: the ``nn.ModuleList`` child that the plan's
    per-layer entries (``layers.*.…``, GPT-J's ``h.*.…``) index; None when they index
    several (HRM's ``H_module.layers`` and ``L_module.layers``): tensor parallelism only,
    no pipeline stages."""
    names = {key.split(".", 1)[0] for key in plan if ".*." in key}
    if len(names) != 1 or not isinstance(getattr(base, next(iter(names)), None), nn.ModuleList):
        return None
    return names.pop()


def _final_norm(base: nn.Module, taken: set[str]) -> str | None:
    """The base model's final norm: ``norm``, else its one direct child named like a norm
    (``final_layernorm``, ``final_layer_norm``, ``ln_f``), else its one direct child with
    parameters other than the embedding and the decoder layers (None when none is found:
    no pipeline stages)."""
    children = [(n, m) for n, m in base.named_children() if n not in taken]
    if any(n == "norm" for n, _ in children):
        return "norm"
    named = [n for n, _ in children if "norm" in n.lower() or n == "ln_f"]
    if len(named) == 1:
        return named[0]
    found = [n for n, m in children if any(True for _ in m.parameters())]
    return found[0] if len(found) == 1 else None


# attention modules whose fused q/k/v interleaves the heads (each head's q, k, v rows in
# turn): a unit's rows are contiguous, the module splits them per head itself
PER_HEAD_QKV = ("GPTNeoXAttention",)


def _is_attention(module: nn.Module) -> bool:
    """An attention module: Llama-style (``head_dim`` and ``num_key_value_groups``), or a
    module named ``*Attention`` with a head size (GPT-NeoX's ``head_size``, GPT-J's and
    CodeGen's ``head_dim``)."""
    if hasattr(module, "head_dim") and hasattr(module, "num_key_value_groups"):
        return True
    return type(module).__name__.endswith("Attention") and (hasattr(module, "head_dim") or hasattr(module, "head_size"))


def _block_roles(parent, by_style, modules, attn, head_units, n_heads, n_kv, head_dim) -> dict[str, Role]:
    cols, rows = by_style.get("colwise", []), by_style.get("rowwise", [])
    if len(rows) != 1 or not cols:
        raise UnsupportedModelError(
            f"block {parent} needs column-parallel linears and exactly one row-parallel "
            f"partner; the plan gives colwise={cols} rowwise={rows}")
    roles = {n: Role("partial", REPLICATED) for n in by_style.get("replicated_with_grad_allreduce", [])}
    if not attn:
        width = modules[rows[0]].in_features
        for n in cols:
            out = modules[n].out_features
            if out % width or out < width:
                raise UnsupportedModelError(f"{n} has {out} outputs, its partner {rows[0]} takes {width}")
            roles[n] = Role("column", FFN, fused=out // width)  # out = k x width: k fused chunks (gate, up)
        roles[rows[0]] = Role("row", FFN)
        return roles
    if modules[rows[0]].in_features != n_heads * head_dim:
        raise UnsupportedModelError(f"{rows[0]} does not take num_attention_heads x head_dim inputs")
    contiguous = type(modules[parent]).__name__ in PER_HEAD_QKV or hasattr(modules[parent], "mp_num")
    for n in cols:
        out = modules[n].out_features
        if contiguous and out == 3 * n_heads * head_dim and n_heads % n_kv == 0:
            if head_units or (n_heads != n_kv and not hasattr(modules[parent], "mp_num")):
                raise UnsupportedModelError(f"{n}: a fused q/k/v by head is supported for multi-head attention "
                                            "at a base TP up to its heads")
            # GPT-NeoX's query_key_value (per head: q, k, v rows), CodeGen's qkv_proj (per
            # mp_num block: q, v, k rows): a unit's rows are contiguous, the module splits them
            roles[n] = Role("column", ATTN, fused=3, per_head=3 * head_dim)
        elif out == 2 * n_heads * head_dim and n.endswith("q_proj"):
            # a gated query (Qwen 3.5, Qwen3-Next: each head's query rows then its gate rows,
            # split by the module per head): a unit's rows are contiguous
            roles[n] = Role("column", ATTN, fused=2, per_head=2 * head_dim)
        elif out == n_heads * head_dim and (n_heads != n_kv or not n.endswith(("k_proj", "v_proj"))):
            roles[n] = Role("column", ATTN, per_head=head_dim)
        elif out == n_kv * head_dim:
            roles[n] = Role("kv", KV if head_units else ATTN, per_head=head_dim)
        elif out == n_heads:
            roles[n] = Role("column", ATTN, per_head=1)  # one gate per query head (LFM3's g_proj)
        elif out == (n_heads + 2 * n_kv) * head_dim and not head_units:
            # fused q, k, v (Phi-3's qkv_proj): a unit is a KV group's query rows, K rows, V rows
            roles[n] = Role("column", ATTN, chunk_rows=((n_heads // n_kv) * head_dim, head_dim, head_dim))
        else:
            raise UnsupportedModelError(f"{n} has {out} outputs: neither query heads, KV heads nor fused q/k/v "
                                        "by KV group (fused q/k/v above the KV heads is not supported)")
    if sum(1 for n in cols if roles[n].kind == "column" and roles[n].per_head != 1) != 1 and n_heads != n_kv:
        raise UnsupportedModelError(f"block {parent} needs exactly one query projection")
    roles[rows[0]] = Role("row", ATTN)
    roles.update(_projection_norms(parent, modules, roles, cols, head_units, head_dim))
    return roles


def _mla_roles(parent, by_style, modules, head_units, n_heads, n_kv) -> dict[str, Role]:
    """Multi-head latent attention (MiniCPM3, DeepSeek-V2 style): every head its own KV head
    (the latent is expanded per head by ``kv_b_proj``); a unit is a head, its rows of each
    column projection (q or q_b: its q rows; kv_b: its k-nope and v rows) and its o_proj
    columns. The latent projections (kv_a, q_a and their norms) feed every head: replicated,
    partial gradients."""
    cols, rows = by_style.get("colwise", []), by_style.get("rowwise", [])
    if len(rows) != 1 or not cols or n_heads != n_kv or head_units:
        raise UnsupportedModelError(f"multi-head latent attention {parent}: needs column projections, one "
                                    "row-parallel partner, as many KV heads as heads and a base TP up to the heads")
    roles = {n: Role("partial", REPLICATED) for n in by_style.get("replicated_with_grad_allreduce", [])}
    for n in (*cols, rows[0]):
        width = modules[n].in_features if n == rows[0] else modules[n].out_features
        if width % n_heads:
            raise UnsupportedModelError(f"{n}: {width} is not a multiple of the {n_heads} heads")
    for n in cols:
        roles[n] = Role("column", ATTN, per_head=modules[n].out_features // n_heads)
    roles[rows[0]] = Role("row", ATTN)
    return roles


def _projection_norms(parent, modules, roles, cols, head_units, head_dim) -> dict[str, Role]:
    """OLMo 2's q_norm / k_norm: an RMSNorm over a whole column projection's output (its
    weight as long as the projection's outputs, longer than a head). It becomes a
    distributed norm (``hf_layers.DistributedRMSNorm``): its weight sharded like the
    projection's rows, the sum of squares all-reduced over the TP group (one float per
    token), never a gather."""
    sizes = {modules[n].out_features: roles[n] for n in cols}
    out = {}
    for leaf, child in modules[parent].named_children():
        path = f"{parent}.{leaf}"
        params = dict(child.named_parameters())
        if path in roles or list(params) != ["weight"] or params["weight"].dim() != 1:
            continue
        size = params["weight"].shape[0]
        if size == head_dim or size not in sizes:
            continue  # a per-head norm (Qwen3's) or not over a projection: replicated
        if not type(child).__name__.endswith("RMSNorm") or norm_eps(child) is None:
            raise UnsupportedModelError(f"{path}: a norm over the whole of a column-parallel projection that is "
                                        "not an RMSNorm (with variance_epsilon or eps): not supported")
        if head_units:
            raise UnsupportedModelError(f"{path}: a norm over a whole q/k projection (OLMo 2) at a base TP above "
                                        "the KV heads (replicated KV units) is not supported")
        out[path] = Role("norm", sizes[size].family)
    return out


def norm_eps(module: nn.Module) -> float | None:
    for attr in ("variance_epsilon", "eps"):
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _specs(model, roles, blocks, vocab_modules, counts, n_heads, n_kv, head_dim, head_units, config,
           head_params=frozenset(), mla_blocks=frozenset()) -> list[ParamSpec]:
    std = float(getattr(config, "initializer_range", 0.02))
    per_attn_unit = 1 if head_units else n_heads // n_kv  # query heads per attention unit
    kv_rows = head_dim  # a K or V unit is one KV head's rows
    specs = []
    for name, p in model.named_parameters():  # a tied output layer appears once
        module, leaf = name.rsplit(".", 1)
        shape = tuple(p.shape)
        if module in vocab_modules:
            specs.append(ParamSpec(name, shape, VOCAB, shape[0] // counts[VOCAB], std))
            continue
        if name in head_params:
            specs.append(ParamSpec(name, shape, ATTN, per_attn_unit, 0.0, 0.0))
            continue
        role = roles.get(module)
        inside = any(module.startswith(b + ".") or module == b for b in blocks)
        if role is None or role.kind == "partial":
            in_mla = any(module.startswith(b + ".") for b in mla_blocks)
            if inside and role is None and len(shape) >= 2 and not in_mla:
                raise UnsupportedModelError(f"parameter {name} inside a planned block is not in the tp plan")
            # a small parameter inside a planned block that the plan does not name (Apertus's
            # learnable activation, alpha_p / alpha_n) acts on the block's sharded activations:
            # replicated, its gradient partial (summed over the TP group once); the fidelity
            # self-test refuses the model if it acts on replicated ones instead
            const = 1.0 if len(shape) == 1 and "norm" in module.rsplit(".", 1)[-1] else 0.0
            init = std if len(shape) >= 2 else 0.0
            specs.append(ParamSpec(name, shape, REPLICATED, shape[0] if shape else 1, init, const,
                                   partial_grad=role is not None or inside))
            continue
        if role.kind == "row":
            if leaf == "bias":  # added after the reduction: replicated, identical gradients
                specs.append(ParamSpec(name, shape, REPLICATED, shape[0], 0.0, 0.0))
                continue
            canon = (shape[1], shape[0])
            specs.append(ParamSpec(name, canon, role.family, canon[0] // counts[role.family], std,
                                   transposed=True))
            continue
        if role.kind == "norm":  # a distributed norm's weight: sharded like its projection's rows
            specs.append(ParamSpec(name, shape, role.family, shape[0] // counts[role.family], 0.0, 1.0))
            continue
        chunk_rows = role.chunk_rows
        if role.family == ATTN and role.kind == "column":
            rows = sum(chunk_rows) if chunk_rows else per_attn_unit * (role.per_head or head_dim * role.fused)
        elif role.kind == "kv":
            rows = role.per_head or kv_rows
        else:
            rows = shape[0] // counts[role.family]
            chunk_rows = (rows // role.fused,) * role.fused if role.fused > 1 else ()
        init = std if leaf == "weight" else 0.0
        specs.append(ParamSpec(name, shape, role.family, rows, init, chunk_rows=chunk_rows))
    return specs
