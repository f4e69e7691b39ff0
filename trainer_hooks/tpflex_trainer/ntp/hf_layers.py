"""The modules that replace a Hugging Face model's planned linears, embedding and output
layer. Each holds a member's unit rows (unit-major) as parameters; HF's own modules keep
everything else (norms, RoPE, attention kernels)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from tpflex_trainer.ntp.errors import UnsupportedModelError
from tpflex_trainer.ntp.layers import Group, copy_to_tp, reduce_from_tp, vocab_lookup


class LocalLinear(nn.Module):
    """A column-parallel linear: this member's output rows (no collective: the block's
    input went through copy-to-TP once, see ``copy_to_tp_at_input``)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class FusedLocalLinear(nn.Module):
    """A fused column-parallel projection (GLM's ``gate_up_proj``: gate and up; Phi-3's
    ``qkv_proj``: q, k and v), whose chunks the model splits itself: the member's units are
    stored unit-major (each unit's rows of every chunk in turn, ``chunk_rows`` per unit) and
    regrouped chunk-major for the product, so the model's own split sees [gate of the local
    units | up of the local units]."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, chunk_rows: tuple[int, ...]) -> None:
        super().__init__()
        self.weight, self.bias, self.chunk_rows = weight, bias, list(chunk_rows)

    def _regroup(self, t: torch.Tensor) -> torch.Tensor:
        units = t.reshape(-1, sum(self.chunk_rows), *t.shape[1:])
        return torch.cat([c.reshape(-1, *t.shape[1:]) for c in units.split(self.chunk_rows, dim=1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else self._regroup(self.bias)
        return F.linear(x, self._regroup(self.weight), b)


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


class DistributedRMSNorm(nn.Module):
    """An RMSNorm over a whole column-parallel projection's output (OLMo 2's q_norm /
    k_norm over all heads) on a member's columns: the sum of squares of its columns,
    all-reduced over the TP group (one float per token: forward sum; backward sum, since
    every member's columns depend on it), divided by the full width; the weight is the
    member's rows of the norm's weight, sharded like the projection's. OLMo 2's arithmetic:
    fp32, ``(weight * x * rsqrt(mean(x^2) + eps)).to(dtype)``."""

    def __init__(self, weight: nn.Parameter, full: int, eps: float, group: Group) -> None:
        super().__init__()
        self.weight, self.full, self.eps, self.group = weight, int(full), float(eps), group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        squares = reduce_from_tp(copy_to_tp(h.pow(2).sum(-1, keepdim=True), self.group), self.group)
        h = h * torch.rsqrt(squares / self.full + self.eps)
        return (self.weight * h).to(dtype)


class RowParallel(nn.Module):
    """A row-parallel linear (weight stored transposed, rows by unit): local product,
    sum over the TP group, then the (replicated) bias once."""

    def __init__(self, weight_t: nn.Parameter, bias: nn.Parameter | None, group: Group) -> None:
        super().__init__()
        self.weight_t, self.bias, self.group = weight_t, bias, group

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        out = reduce_from_tp(torch.matmul(x_local, self.weight_t), self.group)
        return out if self.bias is None else out + self.bias


class VocabParallelHead(nn.Module):
    """The causal LM's ``lm_head``: this member's vocab rows of the logits. HF's own
    ``*ForCausalLM.forward`` runs around it, so whatever the model does to its logits
    after the head (Granite's ``logits_scaling``, Cohere's ``logit_scale``, Gemma 2's
    soft-capping: elementwise, so it commutes with the vocab sharding) is HF's code on the
    member's columns; the vocab-parallel cross-entropy then takes those logits."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group: Group) -> None:
        super().__init__()
        self.weight, self.bias, self.group = weight, bias, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class VocabParallelEmbedding(nn.Module):
    """The model's own embedding module (``nn.Embedding`` or a subclass such as Gemma 3's
    scaled embedding) over this member's vocab rows, by delegation: token ids become local
    rows (clamped where another member owns the token), the model's module runs on them,
    rows of tokens owned elsewhere are zeroed, and the TP group sums. Exactly one member
    owns each token, so the sum is the owner's output of the model's own forward, whatever
    per-token function it computes (a scale, a cast). ``padding_idx`` keeps its meaning:
    the padding row, on the member that owns it, receives no gradient from the lookup."""

    def __init__(self, inner: nn.Embedding, weight: nn.Parameter, units: tuple[int, ...], vocab_block: int,
                 vocab: int, group: Group) -> None:
        super().__init__()
        if inner.max_norm is not None or inner.scale_grad_by_freq or inner.sparse:
            raise UnsupportedModelError(f"{type(inner).__name__}: an embedding with max_norm, "
                                        "scale_grad_by_freq or sparse gradients is not supported")
        lookup = vocab_lookup(units, vocab_block, vocab, weight.device)
        pad = inner.padding_idx
        inner.padding_idx = None if pad is None or int(lookup[pad]) < 0 else int(lookup[pad])
        inner.weight = weight
        inner.num_embeddings = int(weight.shape[0])
        self.inner, self.units, self.group = inner, units, group
        self.register_buffer("lookup", lookup, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = self.lookup[tokens]
        out = self.inner(local.clamp(min=0))
        owned = (local >= 0).unsqueeze(-1)
        return reduce_from_tp(torch.where(owned, out, torch.zeros((), dtype=out.dtype, device=out.device)),
                              self.group)


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
