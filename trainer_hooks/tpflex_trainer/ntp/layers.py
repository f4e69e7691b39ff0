"""Tensor-parallel layers whose shards are arbitrary *sets of units*, Megatron style.

Each layer holds the row blocks of the units its member owns (unit-major, ascending).
``tp`` is the replica's TP process group (None for a single-member replica). Activations
between layers are replicated across the TP group; a column-parallel layer consumes them
through ``copy_to_tp`` (identity forward, all-reduce backward) and its row-parallel
partner produces them through ``reduce_from_tp`` (all-reduce forward, identity backward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpflex_trainer.ntp.collectives import all_gather, all_reduce
from tpflex_trainer.ntp.errors import LayoutError
from tpflex_trainer.ntp.local_group import LocalGroup

Group = dist.ProcessGroup | LocalGroup | None


def _active(group: Group) -> bool:
    if group is None:
        return False
    if isinstance(group, LocalGroup):
        return group.size() > 1
    return dist.get_world_size(group) > 1


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        if _active(ctx.group):
            all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        x = x.contiguous().clone()
        if _active(group):
            all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _CopyToTP.apply(x, group) if _active(group) else x


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group) if _active(group) else x


class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T; W rows grouped by unit. Input replicated, output sharded."""

    def __init__(self, weight: nn.Parameter, units: tuple[int, ...], group: Group) -> None:
        super().__init__()
        self.weight, self.units, self.group = weight, units, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.group), self.weight)


class RowParallelLinear(nn.Module):
    """y = sum over members of x_local W_t_local (W stored transposed, rows by unit)."""

    def __init__(self, weight_t: nn.Parameter, units: tuple[int, ...], group: Group) -> None:
        super().__init__()
        self.weight_t, self.units, self.group = weight_t, units, group

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(x_local @ self.weight_t, self.group)


def _check_partners(col: ColumnParallelLinear, row: RowParallelLinear, what: str) -> None:
    if col.units != row.units:
        raise LayoutError(
            f"{what}: column units {col.units} differ from row-parallel partner units {row.units}",
            code="partner_unit_mismatch",
        )


class ParallelAttention(nn.Module):
    """Causal self-attention split by KV group: a unit is one KV group with its
    ``heads_per_group`` query heads (GQA); the qkv unit block is [q heads | k | v]."""

    def __init__(self, qkv: ColumnParallelLinear, proj: RowParallelLinear, heads_per_group: int, head_dim: int) -> None:
        super().__init__()
        _check_partners(qkv, proj, "attention")
        self.qkv, self.proj = qkv, proj
        self.hpg, self.head_dim = heads_per_group, head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        groups = len(self.qkv.units)
        qkv = self.qkv(x).view(b, s, groups, self.hpg + 2, self.head_dim)
        q = qkv[:, :, :, : self.hpg].reshape(b, s, groups * self.hpg, self.head_dim)
        k = qkv[:, :, :, self.hpg : self.hpg + 1].expand(b, s, groups, self.hpg, self.head_dim)
        v = qkv[:, :, :, self.hpg + 1 :].expand(b, s, groups, self.hpg, self.head_dim)
        k = k.reshape(b, s, groups * self.hpg, self.head_dim)
        v = v.reshape(b, s, groups * self.hpg, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(out.transpose(1, 2).reshape(b, s, groups * self.hpg * self.head_dim))


class ParallelMLP(nn.Module):
    """GELU MLP split by blocks of FFN columns (fc rows / proj_t rows)."""

    def __init__(self, fc: ColumnParallelLinear, proj: RowParallelLinear) -> None:
        super().__init__()
        _check_partners(fc, proj, "mlp")
        self.fc, self.proj = fc, proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


def vocab_lookup(units: tuple[int, ...], vocab_block: int, vocab: int, device: torch.device) -> torch.Tensor:
    """token id -> local row, or -1 where another member owns the token's vocab block."""
    table = torch.full((vocab,), -1, dtype=torch.long)
    for pos, u in enumerate(units):
        table[u * vocab_block : (u + 1) * vocab_block] = torch.arange(pos * vocab_block, (pos + 1) * vocab_block)
    return table.to(device)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: nn.Parameter, units: tuple[int, ...], vocab_block: int, vocab: int, group: Group) -> None:
        super().__init__()
        self.weight, self.units, self.group = weight, units, group
        self.register_buffer("lookup", vocab_lookup(units, vocab_block, vocab, weight.device), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = self.lookup[tokens]
        mask = (local >= 0).unsqueeze(-1).to(self.weight.dtype)
        return reduce_from_tp(F.embedding(local.clamp(min=0), self.weight) * mask, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy over tokens of logits sharded by vocab rows. One exchange per
    call: each member shares (local max, local sum of exp relative to it, target logit if
    owned); the global log-sum-exp is combined from those."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target_local: torch.Tensor, group: Group) -> torch.Tensor:
        logits = logits.float()
        owned = target_local >= 0
        local_max = logits.max(dim=-1).values
        local_sum = (logits - local_max.unsqueeze(-1)).exp().sum(dim=-1)
        picked = logits.gather(-1, target_local.clamp(min=0).unsqueeze(-1)).squeeze(-1) * owned
        stats = torch.stack([local_max, local_sum, picked])
        parts = all_gather(stats, group) if _active(group) else [stats]
        stacked = torch.stack(parts)  # [members, 3, ...]
        global_max = stacked[:, 0].max(dim=0).values
        total = (stacked[:, 1] * (stacked[:, 0] - global_max).exp()).sum(dim=0)
        target_logit = stacked[:, 2].sum(dim=0)
        loss = (total.log() + global_max - target_logit).mean()
        ctx.save_for_backward(logits, global_max, total, target_local)
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, global_max, total, target_local = ctx.saved_tensors
        softmax = (logits - global_max.unsqueeze(-1)).exp() / total.unsqueeze(-1)
        owned = target_local >= 0
        onehot = torch.zeros_like(softmax)
        onehot.scatter_(-1, target_local.clamp(min=0).unsqueeze(-1), owned.unsqueeze(-1).to(softmax.dtype))
        n = target_local.numel()
        return (softmax - onehot) * (grad / n), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target_local: torch.Tensor, group: Group) -> torch.Tensor:
    """Mean cross-entropy over tokens of ``logits`` sharded by vocab rows (this member's
    columns); ``target_local`` is the target's local column, or -1 where another member
    owns it (``vocab_lookup``)."""
    return _VocabParallelCrossEntropy.apply(logits, target_local, group)


class VocabParallelOutput(nn.Module):
    """Output layer sharded by vocab rows, with the vocab-parallel cross-entropy."""

    def __init__(self, weight: nn.Parameter, units: tuple[int, ...], vocab_block: int, vocab: int, group: Group) -> None:
        super().__init__()
        self.weight, self.units, self.group = weight, units, group
        self.register_buffer("lookup", vocab_lookup(units, vocab_block, vocab, weight.device), persistent=False)

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = F.linear(copy_to_tp(x, self.group), self.weight)
        return vocab_parallel_cross_entropy(logits, self.lookup[targets], self.group)
