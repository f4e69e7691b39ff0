"""What the runtime needs from a model: a *model adapter*.

An adapter describes the model's parameters (``ParamSpec``: canonical name, full shape,
unit family, rows per unit, how the canonical tensor maps to the user's tensor), the unit
counts of its families, the families *derived* from another one (KV heads shared by the
query heads of a replica, see ``layout.Derived``), a fingerprint for checkpoints, the
initial value of a member's rows and a builder that turns a member's local unit-major
tensors into a module whose ``loss(tokens, targets)`` is the local mean next-token loss.

The runtime (layout, reshard, gradient sync, optimizer, checkpoints) only talks to this
interface: the built-in GPT (``GPTAdapter``) and Hugging Face models (``hf_adapter``) are
two adapters of one runtime.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tpflex_trainer.ntp.config import REPLICATED, GPTConfig, ParamSpec, param_specs
from tpflex_trainer.ntp.layers import Group
from tpflex_trainer.ntp.layout import Derived


class ModelAdapter:
    """Base class; subclasses set ``specs``, ``unit_counts``, ``derived`` and implement
    ``fingerprint`` and ``build``."""

    specs: list[ParamSpec]
    unit_counts: dict[str, int]  # primary families, placed by the layout
    derived: Mapping[str, Derived] = {}
    vocab: int = 0
    n_layers: int = 1  # decoder layers, for pipeline stages
    hidden: int = 0  # width of the activations between stages
    tied: bool = False  # input and output embeddings share one tensor

    def place_of(self, name: str) -> int | str:
        """Where parameter ``name`` lives for pipeline stages: its decoder layer index,
        ``stages.FIRST`` (embedding) or ``stages.LAST`` (final norm, output layer)."""
        raise NotImplementedError

    def build_stage(self, units: Mapping[str, tuple[int, ...]], tensors: Mapping[str, torch.Tensor],
                    group: Group, stage: int, n_stages: int) -> nn.Module:
        """The module of one pipeline stage over the stage's tensors: ``forward_stage(x)``
        (tokens on the first stage, the previous stage's hidden states otherwise) and,
        on the last stage, ``stage_loss(x, targets)``."""
        raise NotImplementedError

    def fingerprint(self) -> dict[str, Any]:
        """Fields a checkpoint must match (compared field by field)."""
        raise NotImplementedError

    def build(self, units: Mapping[str, tuple[int, ...]], tensors: Mapping[str, torch.Tensor],
              group: Group) -> nn.Module:
        """A module over ``tensors`` (wrapped as parameters without copying) with
        ``loss(tokens, targets)`` and ``params_in_spec_order()``."""
        raise NotImplementedError

    def all_unit_counts(self) -> dict[str, int]:
        out = dict(self.unit_counts)
        for fam, d in self.derived.items():
            out[fam] = -(-self.unit_counts[d.source] // d.per_unit)
        return out

    def initial_local(self, spec: ParamSpec, units: tuple[int, ...], seed: int) -> torch.Tensor:
        """The member's rows of ``spec`` at step 0 (fp32, CPU): a function of
        (seed, name) only, so every layout starts from the same model."""
        from tpflex_trainer.ntp.state import full_init

        full = full_init(spec, seed)
        if spec.family == REPLICATED:
            return full
        return torch.cat([full[u * spec.unit_rows:(u + 1) * spec.unit_rows] for u in units]) if units else full[:0]

    def describe(self) -> str:
        return f"{type(self).__name__}({self.fingerprint()})"


class GPTAdapter(ModelAdapter):
    """The built-in GPT (``GPTConfig``/``ShardedGPT``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        self.cfg = cfg
        self.specs = param_specs(cfg)
        self.unit_counts = cfg.unit_counts()
        self.derived = {}
        self.vocab = cfg.vocab
        self.n_layers = cfg.n_layers
        self.hidden = cfg.hidden

    def fingerprint(self) -> dict[str, Any]:
        return self.cfg.to_dict()

    def build(self, units, tensors, group) -> nn.Module:
        from tpflex_trainer.ntp.model import ShardedGPT

        return ShardedGPT(self.cfg, units, tensors, group)

    def place_of(self, name: str) -> int | str:
        from tpflex_trainer.ntp.stages import FIRST, LAST

        if name.startswith(("embed.", "pos.")):
            return FIRST
        if name.startswith(("lnf.", "head.")):
            return LAST
        return int(name.split(".", 1)[0][1:])  # "h<i>."

    def build_stage(self, units, tensors, group, stage, n_stages) -> nn.Module:
        from tpflex_trainer.ntp.model import ShardedGPT
        from tpflex_trainer.ntp.stages import layer_ranges

        layers = layer_ranges(self.cfg.n_layers, n_stages)[stage]
        return ShardedGPT(self.cfg, units, tensors, group, layers=layers, first=stage == 0,
                          last=stage == n_stages - 1)


def as_adapter(model: Any, base_tp: int) -> ModelAdapter:
    """A ``GPTConfig``, an adapter, or a Hugging Face model directory (path)."""
    if isinstance(model, ModelAdapter):
        return model
    if isinstance(model, GPTConfig):
        return GPTAdapter(model)
    from tpflex_trainer.ntp.hf_adapter import HfAdapter

    return HfAdapter.from_pretrained_dir(model, base_tp)
