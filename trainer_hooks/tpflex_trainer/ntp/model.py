"""A small GPT built from the unit-sharded TP layers (pre-LN, learned positions, GELU MLP,
GQA attention, untied vocab-parallel embedding and output layer, no linear biases)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from tpflex_trainer.ntp.config import GPTConfig, ParamSpec, param_specs
from tpflex_trainer.ntp.layers import (
    ColumnParallelLinear,
    Group,
    ParallelAttention,
    ParallelMLP,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelOutput,
)


class _LayerNorm(nn.Module):
    def __init__(self, weight: nn.Parameter, bias: nn.Parameter) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias)


class _Block(nn.Module):
    def __init__(self, ln1: _LayerNorm, attn: ParallelAttention, ln2: _LayerNorm, mlp: ParallelMLP) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = ln1, attn, ln2, mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ShardedGPT(nn.Module):
    """The GPT slice one TP member holds. ``tensors`` (name -> local unit-major tensor) are
    wrapped as parameters without copying, so the optimizer updates them in place."""

    def __init__(
        self,
        cfg: GPTConfig,
        units: Mapping[str, tuple[int, ...]],
        tensors: Mapping[str, torch.Tensor],
        group: Group,
        layers: range | None = None,
        first: bool = True,
        last: bool = True,
    ) -> None:
        """``layers``/``first``/``last``: one pipeline stage (its layers; the embedding on
        the first stage, the final norm and output layer on the last)."""
        super().__init__()
        self.cfg, self.first, self.last = cfg, first, last
        layers = range(cfg.n_layers) if layers is None else layers
        self.specs: list[ParamSpec] = [s for s in param_specs(cfg) if s.name in tensors]
        self.by_name = {s.name: nn.Parameter(tensors[s.name]) for s in self.specs}
        p = self.by_name
        if first:
            self.embed = VocabParallelEmbedding(p["embed.weight"], units["vocab"], cfg.vocab_block, cfg.vocab, group)
            self.pos = p["pos.weight"]
        blocks = []
        for i in layers:
            n = f"h{i}."
            attn = ParallelAttention(
                ColumnParallelLinear(p[n + "attn.qkv.weight"], units["kv_groups"], group),
                RowParallelLinear(p[n + "attn.proj.weight_t"], units["kv_groups"], group),
                cfg.heads_per_group,
                cfg.head_dim,
            )
            mlp = ParallelMLP(
                ColumnParallelLinear(p[n + "mlp.fc.weight"], units["ffn"], group),
                RowParallelLinear(p[n + "mlp.proj.weight_t"], units["ffn"], group),
            )
            ln1 = _LayerNorm(p[n + "ln1.weight"], p[n + "ln1.bias"])
            ln2 = _LayerNorm(p[n + "ln2.weight"], p[n + "ln2.bias"])
            blocks.append(_Block(ln1, attn, ln2, mlp))
        self.blocks = nn.ModuleList(blocks)
        if last:
            self.lnf = _LayerNorm(p["lnf.weight"], p["lnf.bias"])
            self.head = VocabParallelOutput(p["head.weight"], units["vocab"], cfg.vocab_block, cfg.vocab, group)

    def params_in_spec_order(self) -> list[tuple[ParamSpec, nn.Parameter]]:
        return [(s, self.by_name[s.name]) for s in self.specs]

    def forward_stage(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states -> hidden states after the stage's layers."""
        if self.first:
            x = self.embed(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            x = block(x)
        return x

    def stage_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage: its layers, the final norm, the output layer and the loss."""
        return self.head.loss(self.lnf(self.forward_stage(x)), targets)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over the local batch ([B, S] token ids)."""
        return self.stage_loss(tokens, targets)
