"""``HfAdapter``: a Hugging Face ``transformers`` causal LM under NTP.

The user's model class is built from its config (parameters on the meta device), its
planned linears are swapped for unit shards wrapped with the TP collectives (see
``hf_plan`` and ``hf_layers``), and HF's own code runs the rest. Initial weights come from
the model directory's safetensors (each member reads only its units' rows) or, without
weights, from a seeded per-parameter init.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tpflex_trainer.ntp import dropout, hf_selftest
from tpflex_trainer.ntp.adapter import ModelAdapter
from tpflex_trainer.ntp.config import REPLICATED, ParamSpec, to_user
from tpflex_trainer.ntp.errors import ConfigError, NtpError, UnsupportedModelError
from tpflex_trainer.ntp.hf_layers import (
    DistributedRMSNorm,
    ExpandedKVLinear,
    FusedLocalLinear,
    LocalLinear,
    RowParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
    copy_to_tp_at_input,
    parameters_on_meta,
)
from tpflex_trainer.ntp.hf_plan import (
    ATTN,
    KV,
    VOCAB,
    HfPlan,
    analyse,
    attention_heads,
    check_base_tp,
    norm_eps,
)
from tpflex_trainer.ntp.layers import Group, vocab_lookup, vocab_parallel_cross_entropy


def load_config(path: str | os.PathLike):
    from transformers import AutoConfig

    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"{path} is not a Hugging Face model directory (no config.json)")
    return AutoConfig.from_pretrained(str(path))


def lm_from_config(config, **kwargs) -> nn.Module:
    """``AutoModelForCausalLM.from_config``, and for a text config of a composite model type
    that the auto mapping does not register (Emu3's), the mapped causal LM class whose
    ``config_class`` it is."""
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        return AutoModelForCausalLM.from_config(config, **kwargs)
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
        for name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
            cls = getattr(transformers, name, None) if isinstance(name, str) else None
            if cls is not None and getattr(cls, "config_class", None) is type(config):
                return cls._from_config(config, **kwargs)
        raise


def build_meta_model(config) -> nn.Module:
    """The user's causal LM class with parameters on the meta device, fp32, with the
    attention implementation the config asks for (HF's default where it names none: never
    forced, since some families need eager attention). Built from a copy of ``config``:
    ``from_config`` records the dtype it builds in on the config it is given, and the
    user's config (its ``dtype`` included) is what ``export_hf`` writes."""
    config = copy.deepcopy(config)
    with parameters_on_meta():
        model = lm_from_config(config, dtype=torch.float32)
    return model


def keyed_reference(model: nn.Module) -> None:
    """``dropout.keyed`` for the whole single-process model, its attention modules found as
    the adapter finds them (``hf_plan``: Llama-style ones, GPT-NeoX's, GPT-J's, CodeGen's,
    latent attention): each holds every query head, in order. Where the model has no plan
    the adapter could analyse, ``dropout.keyed_reference``."""
    try:
        plan = analyse(model, model.config, 1)
    except Exception:  # noqa: BLE001 - no plan: the dropout module's own detection
        dropout.keyed_reference(model)
        return
    heads = tuple(range(plan.n_heads))
    attn = {p for p, kind in plan.blocks.items() if kind == ATTN}
    dropout.keyed(model, lambda path, _m: heads if path in attn else None)


class HfShard(nn.Module):
    """One member's slice of the user's model (of one pipeline stage: its decoder layers,
    the embedding on the first stage, the final norm and output layer on the last).
    ``forward_stage`` runs HF's base model over the stage's layers (token ids in on the
    first stage, the previous stage's hidden states as ``inputs_embeds`` otherwise);
    ``stage_loss`` runs HF's whole ``*ForCausalLM.forward`` (its ``lm_head`` holding the
    member's vocab rows, so the model's own logit post-processing runs on them) and the
    vocab-parallel cross-entropy over the logits it returns."""

    def __init__(self, lm: nn.Module, lookup: torch.Tensor | None, group: Group, params: dict[str, nn.Parameter],
                 specs: list[ParamSpec], first: bool = True) -> None:
        super().__init__()
        self.lm, self.specs, self.by_name, self.first, self.group = lm, specs, params, first, group
        if lookup is not None:
            self.register_buffer("lookup", lookup, persistent=False)

    def params_in_spec_order(self) -> list[tuple[ParamSpec, nn.Parameter]]:
        return [(s, self.by_name[s.name]) for s in self.specs]

    def _given(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"input_ids": x} if self.first else {"inputs_embeds": x}

    def dropout_scope(self, seed: int, step: int, first_sample: int, batch: int):
        """Dropout masks of one micro-batch's forward, keyed by (seed, step, global sample,
        module, unit): see ``dropout``."""
        return dropout.scope(seed, step, first_sample, batch, int(self.lm.config.hidden_size))

    def forward_stage(self, x: torch.Tensor) -> torch.Tensor:
        base = getattr(self.lm, self.lm.base_model_prefix)
        return base(**self._given(x), use_cache=False).last_hidden_state

    def local_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The logits HF's forward produces, over this member's vocab rows."""
        return self.lm(**self._given(x), use_cache=False).logits

    def stage_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(self.local_logits(x), self.lookup[targets], self.group)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.stage_loss(tokens, targets)


def local_attention_config(block: nn.Module, groups: int, plan: HfPlan) -> None:
    """An attention module whose fused q/k/v the model splits by its config's head counts
    (Phi-3: ``query_pos = config.num_attention_heads * head_dim``) gets its own copy of the
    config with this member's counts (``groups`` KV groups and their query heads), and its
    ``num_heads`` / ``num_key_value_heads`` attributes likewise where it has them."""
    heads = groups * (plan.n_heads // plan.n_kv)
    config = copy.copy(block.config)
    config.num_attention_heads, config.num_key_value_heads = heads, groups
    block.config = config
    for attr, value in (("num_heads", heads), ("num_key_value_heads", groups)):
        if hasattr(block, attr):
            setattr(block, attr, value)


def local_attention_blocks(block: nn.Module, n_units: int, plan: HfPlan) -> None:
    """CodeGen's attention splits its fused q/v/k into ``mp_num`` blocks of
    ``embed_dim / mp_num`` rows (each [q | v | k] of n_heads / mp_num heads): a member holding
    ``n_units`` blocks gets that many, and the matching ``embed_dim``, so the model's own
    split sees its blocks."""
    per_block = int(block.embed_dim) // int(block.mp_num)
    block.mp_num, block.embed_dim = n_units, n_units * per_block
    if hasattr(block, "num_attention_heads"):
        block.num_attention_heads = n_units * (plan.n_heads // plan.n_kv)


class HfAdapter(ModelAdapter):
    def __init__(self, config, base_tp: int, weights_dir: str | os.PathLike | None = None,
                 self_test: bool = True) -> None:
        """``self_test``: run the fidelity self-test (``hf_selftest``; once per process and
        config) and refuse a model that fails it; ``TPFLEX_SKIP_SELF_TEST=1`` skips it
        with a warning."""
        # refused before HF builds the model (it divides by num_key_value_heads)
        check_base_tp(base_tp)
        if getattr(config, "num_attention_heads", None) is not None:
            attention_heads(config)
        self.config = config
        self.base_tp = base_tp
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        try:
            self.plan: HfPlan = analyse(build_meta_model(config), config, base_tp)
        except NtpError:
            raise
        except Exception as exc:  # noqa: BLE001 - HF could not build or describe it: refused, with why
            raise UnsupportedModelError(f"{type(config).__name__}: the model could not be built on the meta device "
                                        f"and analysed ({type(exc).__name__}: {exc})") from exc
        self.specs = self.plan.specs
        self.unit_counts = {f: n for f, n in self.plan.unit_counts.items()}
        self.derived = dict(self.plan.derived)
        self.vocab = int(config.vocab_size)
        self.n_layers = int(config.num_hidden_layers)
        self.hidden = int(config.hidden_size)
        self.tied = bool(self.plan.tied)
        self.prefix = self.plan.prefix
        self._chunk_rows = {s.name: s.chunk_rows for s in self.specs}
        self._unit_rows = {s.name: s.unit_rows for s in self.specs}
        self._reader = None
        self.fidelity = hf_selftest.check(config, HfAdapter, self.plan.head_units) if self_test else None

    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike, base_tp: int) -> HfAdapter:
        """A HF model directory: config.json, and weights (model.safetensors or a sharded
        index) when present."""
        from tpflex_trainer.ntp.hf_io import has_weights

        config = load_config(path)
        return cls(config, base_tp, path if has_weights(path) else None)

    # ------------------------------------------------------------------ adapter
    def fingerprint(self) -> dict[str, Any]:
        c, p = self.config, self.plan
        layout = json.dumps([(s.name, list(s.shape), s.family, s.unit_rows) for s in self.specs])
        return {
            "model_type": str(c.model_type), "vocab_size": int(c.vocab_size),
            "hidden_size": int(c.hidden_size), "num_hidden_layers": int(c.num_hidden_layers),
            "num_attention_heads": p.n_heads, "num_key_value_heads": p.n_kv, "head_dim": p.head_dim,
            "tie_word_embeddings": bool(p.tied), "head_units": bool(p.head_units),
            "unit_counts": {k: int(v) for k, v in sorted(p.unit_counts.items())},
            "params_sha": hashlib.sha256(layout.encode()).hexdigest()[:16],
        }

    def initial_local(self, spec: ParamSpec, units: tuple[int, ...], seed: int) -> torch.Tensor:
        if self.weights_dir is None:
            return super().initial_local(spec, units, seed)
        from tpflex_trainer.ntp.hf_io import SafetensorsReader, checkpoint_renamer

        if self._reader is None:
            self._reader = SafetensorsReader(self.weights_dir, checkpoint_renamer(build_meta_model(self.config)))
        return self._reader.rows(spec, units)

    def build(self, units: Mapping[str, tuple[int, ...]], tensors: Mapping[str, torch.Tensor],
              group: Group) -> nn.Module:
        return self.build_stage(units, tensors, group, 0, 1)

    def place_of(self, name: str) -> int | str:
        from tpflex_trainer.ntp.stages import FIRST, LAST

        p, plan = self.prefix, self.plan
        if name.startswith(f"{p}.{plan.embed}."):
            return FIRST
        if name.startswith(f"{plan.head}.") or (plan.norm is not None and name.startswith(f"{p}.{plan.norm}.")):
            return LAST
        if plan.layers is not None and name.startswith(f"{p}.{plan.layers}."):
            return int(name[len(f"{p}.{plan.layers}."):].split(".", 1)[0])
        raise UnsupportedModelError(f"parameter {name} is neither in a decoder layer, the embedding, "
                                    "the final norm nor the output layer: no pipeline stage for it")

    def build_stage(self, units: Mapping[str, tuple[int, ...]], tensors: Mapping[str, torch.Tensor],
                    group: Group, stage: int, n_stages: int) -> nn.Module:
        from tpflex_trainer.ntp.stages import layer_ranges

        self._reader = None  # done loading: close the files
        layers = layer_ranges(self.n_layers, n_stages)[stage]
        first, last = stage == 0, stage == n_stages - 1
        lm = build_meta_model(self.config)
        lm.train()
        base = getattr(lm, lm.base_model_prefix)
        modules = dict(lm.named_modules())
        attn_blocks = {p for p, kind in self.plan.blocks.items() if kind == ATTN}
        dropout.keyed(lm, lambda path, _m: self.local_heads(units) if path in attn_blocks else None)
        specs = [s for s in self.specs if s.name in tensors]
        params = {s.name: nn.Parameter(tensors[s.name]) for s in specs}
        plan = self.plan
        if plan.layers is None and n_stages > 1:
            raise UnsupportedModelError(f"{type(lm).__name__}: its tp plan indexes several layer lists (no single "
                                        "decoder-layer list to split into pipeline stages)")
        in_stage = {f"{self.prefix}.{plan.layers}.{i}" for i in layers}

        def mine(path: str) -> bool:
            return plan.layers is None or any(path == q or path.startswith(q + ".") for q in in_stage)

        for path, role in self.plan.roles.items():
            if not mine(path):
                continue
            module = modules[path]
            if role.kind == "partial":
                self._set_params(module, path, params)
                continue
            w, b = params[f"{path}.weight"], params.get(f"{path}.bias")
            if role.kind == "norm":
                spec = next(s for s in self.specs if s.name == f"{path}.weight")
                new = DistributedRMSNorm(w, spec.shape[0], norm_eps(module), group)
            elif role.kind == "row":
                new = RowParallel(w, b, group)
            elif self._chunk_rows[f"{path}.weight"]:
                new = FusedLocalLinear(w, b, self._chunk_rows[f"{path}.weight"])
                if role.family == ATTN:
                    local_attention_config(modules[path.rsplit(".", 1)[0]], len(units[ATTN]), self.plan)
            elif role.kind == "kv" and role.family == KV:
                index = [units[KV].index(h // (self.plan.n_heads // self.plan.n_kv)) for h in units[ATTN]]
                new = ExpandedKVLinear(w, b, index, self._unit_rows[f"{path}.weight"])
            else:
                new = LocalLinear(w, b)
            parent, leaf = path.rsplit(".", 1)
            setattr(modules[parent], leaf, new)
        for path, kind in self.plan.blocks.items():
            if not mine(path):
                continue
            block = modules[path]
            if kind == ATTN and self.plan.head_units:
                block.num_key_value_groups = 1  # one (gathered) KV head per local query head
            if kind == ATTN and plan.mp_blocks:
                local_attention_blocks(block, len(units[ATTN]), plan)
            copy_to_tp_at_input(block, group)
        if plan.layers is not None:
            setattr(base, plan.layers, nn.ModuleList([getattr(base, plan.layers)[i] for i in layers]))
        types = getattr(base.config, "layer_types", None)
        if n_stages > 1 and isinstance(types, list) and len(types) == self.n_layers:
            # the base model's forward reads ``config.layer_types[i]`` by its position in the
            # (now the stage's) layer list (OLMo 3, Exaone 4: which mask, which RoPE)
            base.config = copy.copy(base.config)
            base.config.layer_types = [types[i] for i in layers]
        embed_name = f"{self.prefix}.{plan.embed}.weight"
        if first:
            setattr(base, plan.embed, VocabParallelEmbedding(getattr(base, plan.embed), params[embed_name],
                                                             units[VOCAB], plan.vocab_block, self.vocab, group))
        else:
            setattr(base, plan.embed, nn.Identity())  # the stage gets hidden states (inputs_embeds)
        lookup = None
        if last:
            head_w = params[embed_name] if plan.tied else params[f"{plan.head}.weight"]
            setattr(lm, plan.head, VocabParallelHead(head_w, params.get(f"{plan.head}.bias"), group))
            lookup = vocab_lookup(units[VOCAB], plan.vocab_block, self.vocab, head_w.device)
        else:
            if plan.norm is not None:
                setattr(base, plan.norm, nn.Identity())  # the final norm runs on the last stage
            setattr(lm, plan.head, nn.Identity())
        for s in specs:
            owner = s.name.rsplit(".", 1)[0]
            if (s.family == REPLICATED and owner not in self.plan.roles) or s.name in plan.head_params:
                self._set_params(modules[owner], owner, params, s.name)
        left = [n for n, p in lm.named_parameters() if p.device.type == "meta"]
        if left:
            raise UnsupportedModelError(f"parameters without a unit layout: {left[:5]}")
        return HfShard(lm, lookup, group, params, specs, first)

    def local_heads(self, units: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
        """The global query heads of a member's attention units, in its local order."""
        if self.plan.head_units:
            return tuple(units[ATTN])
        r = self.plan.n_heads // self.plan.n_kv
        return tuple(g * r + j for g in units[ATTN] for j in range(r))

    @staticmethod
    def _set_params(module: nn.Module, path: str, params: Mapping[str, nn.Parameter], only: str | None = None) -> None:
        for leaf in list(module._parameters):
            name = f"{path}.{leaf}"
            if name in params and (only is None or name == only):
                setattr(module, leaf, params[name])

    # ------------------------------------------------------------------ reference
    def full_state(self, seed: int) -> dict[str, torch.Tensor]:
        """The whole model's initial tensors in the user's layout (HF names and shapes):
        what the single-process reference starts from."""
        out = {}
        for s in self.specs:
            units = tuple(range(s.n_units)) if s.sharded else ()
            canon = self.initial_local(s, units, seed)
            out[s.name] = to_user(s, canon)
        return out
