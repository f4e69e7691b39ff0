"""The modules that replace a Hugging Face model's planned linears, embedding and output
layer. Each holds a member's unit rows (unit-major) as parameters; HF's own modules keep
everything else (norms, RoPE, attention kernels)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from tpflex_trainer.ntp.layers import Group, copy_to_tp, reduce_from_tp


class LocalLinear(nn.Module):
    """A column-parallel linear: this member's output rows (no collective: the block's
    input went through copy-to-TP once, see ``copy_to_tp_at_input``)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ExpandedKVLinear(nn.Module):
    """A K or V projection when KV heads are replicated units: the member holds each of
    its KV heads once and produces one KV head per local query head (``index``: local
    query head -> position of its KV head), so HF's attention sees plain local MHA
    (``num_key_value_groups = 1``). The gather is differentiable: the partial gradients
    of a KV head's uses add up in its one stored copy."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, index: list[int], head_dim: int) -> None:
        super().__init__()
        self.weight, self.bias, self.head_dim = weight, bias, head_dim
        self.register_buffer("index", torch.tensor(index, dtype=torch.long, device=weight.device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(-1, self.head_dim, self.weight.shape[-1]).index_select(0, self.index)
        b = None
        if self.bias is not None:
            b = self.bias.view(-1, self.head_dim).index_select(0, self.index).reshape(-1)
        return F.linear(x, w.reshape(-1, self.weight.shape[-1]), b)


class RowParallel(nn.Module):
    """A row-parallel linear (weight stored transposed, rows by unit): local product,
    sum over the TP group, then the (replicated) bias once."""

    def __init__(self, weight_t: nn.Parameter, bias: nn.Parameter | None, group: Group) -> None:
        super().__init__()
        self.weight_t, self.bias, self.group = weight_t, bias, group

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        out = reduce_from_tp(torch.matmul(x_local, self.weight_t), self.group)
        return out if self.bias is None else out + self.bias


def copy_to_tp_at_input(module: nn.Module, group: Group) -> None:
    """Identity forward / all-reduce backward on the block's input, once for all its
    column-parallel linears (the first positional argument or ``hidden_states``)."""

    def pre_hook(_mod, args, kwargs):
        if args:
            return (copy_to_tp(args[0], group), *args[1:]), kwargs
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = copy_to_tp(kwargs["hidden_states"], group)
        return args, kwargs

    module.register_forward_pre_hook(pre_hook, with_kwargs=True)


@contextmanager
def parameters_on_meta() -> Callable:
    """Build a module with its parameters on the meta device (no memory, no init) while
    buffers (RoPE frequencies) are real."""
    original = nn.Module.register_parameter

    def register(self, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original
