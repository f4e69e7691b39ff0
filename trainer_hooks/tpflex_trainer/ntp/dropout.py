"""Dropout under NTP: masks that do not depend on who draws them.

A replica's TP members hold different numbers of units, so a shared RNG stream would be
consumed differently on each of them. Instead no RNG state is used at all: every mask
element is a counter-based hash of (seed, step, global sample index, module path, the
module's dropout call number, unit, element index). So

* a replicated activation (embedding / residual / hidden dropout, after a row-parallel
  all-reduce) gets the same mask on every member of a replica: the key has no rank in it;
* a sharded activation (the attention probabilities of a member's query heads) gets a
  mask per query head, the same whichever member holds the head, at any TP degree;
* the masks equal the single-process reference's (it draws with the same keys), and a
  step replayed after a reshard, a recovery or a torn step draws the same masks again:
  the key has no micro-batch split, replica batch or TP degree in it.

``keyed(model, heads_of)`` marks a model's modules (their original paths, before any
stage split), ``scope(...)`` makes one forward draw its masks this way: within it
``torch.nn.functional.dropout`` and, with ``dropout_p > 0``,
``scaled_dot_product_attention`` (recomputed in math form, its probabilities through the
same dropout) are keyed; outside a scope they are torch's own. A dropout call on an
activation that is neither a whole hidden state ([batch, ..., hidden]) nor an attention
module's probabilities ([batch, heads, q, k]) cannot be keyed exactly and is refused
(``UnsupportedModelError`` naming the module)."""

from __future__ import annotations

import math
import threading
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tpflex_trainer.ntp.errors import UnsupportedModelError

M32 = 0xFFFFFFFF
_local = threading.local()
_original_dropout = F.dropout
_original_sdpa = F.scaled_dot_product_attention


@dataclass
class _Scope:
    seed: int
    step: int
    first_sample: int
    batch: int
    hidden: int
    stack: list = field(default_factory=list)
    calls: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _Key:
    path: str
    code: int
    heads: tuple[int, ...] | None  # global query heads of an attention module's local heads


def _mix_int(x: int) -> int:
    x &= M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x5BD1E995) & M32
    return x ^ (x >> 16)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """The same 32-bit mix on an int64 tensor of values below 2**32 (no overflow: both
    constants are below 2**31), so the bits are the same on any device."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & M32
    return x ^ (x >> 16)


def _fold(*fields: int) -> int:
    h = 0x2545F491
    for f in fields:
        h = _mix_int(h ^ _mix_int(f & M32) ^ _mix_int((f >> 32) & M32))
    return h


def keep_mask(shape: tuple[int, ...], keys: torch.Tensor, p: float) -> torch.Tensor:
    """A boolean keep mask of ``shape`` whose leading ``keys.ndim`` dimensions are those
    of ``keys`` (one 32-bit key per slice); every element is kept with probability 1 - p,
    from its slice's key and its index within the slice alone."""
    lead = keys.ndim
    inner = math.prod(shape[lead:])
    elem = torch.arange(inner, dtype=torch.int64, device=keys.device)
    k = keys.reshape(*keys.shape, 1)
    x = _mix(elem ^ k)
    x = _mix(x ^ _mix(k ^ 0x68E31DA4))
    return (x >= round(p * 2 ** 32)).reshape(shape)


def _apply(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


def _current() -> _Scope | None:
    return getattr(_local, "scope", None)


def _keyed_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False):
    s = _current()
    if s is None or not training or p == 0.0:
        return _original_dropout(input, p, training, inplace)
    if not s.stack:
        raise UnsupportedModelError(f"dropout {p} outside any module of the model: its mask cannot be "
                                    "drawn identically on every TP member")
    key: _Key = s.stack[-1]
    call = s.calls.get(key.code, 0)
    s.calls[key.code] = call + 1
    if p >= 1.0:
        return input * 0.0
    shape = tuple(input.shape)
    dev = input.device
    samples = torch.arange(s.first_sample, s.first_sample + s.batch, dtype=torch.int64, device=dev)
    base = _fold(s.seed, s.step, key.code, call)
    if key.heads is not None and input.ndim == 4 and shape[0] == s.batch and shape[1] == len(key.heads):
        heads = torch.tensor(key.heads, dtype=torch.int64, device=dev)
        keys = _mix(_mix(base ^ samples)[:, None] ^ (heads[None, :] + 1))  # per sample and query head
        return _apply(input, keep_mask(shape, keys, p), p)
    if input.ndim >= 2 and shape[0] == s.batch and shape[-1] == s.hidden:
        keys = _mix(_mix(base ^ samples))  # per sample, no unit: the same on every member
        return _apply(input, keep_mask(shape, keys, p), p)
    raise UnsupportedModelError(f"{key.path}: dropout {p} on an activation of shape {list(shape)}, neither a "
                                f"whole hidden state (batch {s.batch}, hidden {s.hidden}) nor the attention "
                                "probabilities of its heads: a member may hold only part of it, so its mask "
                                "cannot be drawn exactly under NTP (set the model's dropout to 0.0)")


def _keyed_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                **kwargs):
    if _current() is None or dropout_p == 0.0:
        return _original_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa, **kwargs)
    if kwargs:
        raise UnsupportedModelError(f"scaled_dot_product_attention with {sorted(kwargs)} and dropout")
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        rep = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(rep, dim=-3), value.repeat_interleave(rep, dim=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if is_causal:
        q, k = query.shape[-2], key.shape[-2]
        causal = torch.ones(q, k, dtype=torch.bool, device=query.device).tril(diagonal=k - q)
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout_p, training=True)
    return torch.matmul(probs, value)


def _install() -> None:
    if F.dropout is not _keyed_dropout:
        F.dropout = _keyed_dropout
    if F.scaled_dot_product_attention is not _keyed_sdpa:
        F.scaled_dot_product_attention = _keyed_sdpa


def _push(module, _args):
    s = _current()
    if s is not None:
        s.stack.append(module._tpflex_dropout_key)


def _pop(module, _args, _out):
    s = _current()
    if s is not None and s.stack and s.stack[-1] is module._tpflex_dropout_key:
        s.stack.pop()


def keyed(model: nn.Module, heads_of: Callable[[str, nn.Module], tuple[int, ...] | None]) -> None:
    """Mark every module of ``model`` by its path (call before a stage split renames the
    decoder layers); ``heads_of(path, module)``: the global query heads of an attention
    module's local heads, in order (None for any other module)."""
    _install()
    for path, module in model.named_modules():
        if hasattr(module, "_tpflex_dropout_key"):
            continue
        module._tpflex_dropout_key = _Key(path, zlib.crc32(path.encode()), heads_of(path, module))
        module.register_forward_pre_hook(_push)
        module.register_forward_hook(_pop, always_call=True)


@contextmanager
def scope(seed: int, step: int, first_sample: int, batch: int, hidden: int) -> Iterator[None]:
    """One forward of ``batch`` samples, the first of which is sample ``first_sample`` of
    step ``step``'s global batch: its dropout masks are keyed (this thread only)."""
    _install()
    previous = _current()
    _local.scope = _Scope(int(seed), int(step), int(first_sample), int(batch), int(hidden))
    try:
        yield
    finally:
        _local.scope = previous


def has_dropout(config, model: nn.Module | None = None) -> bool:
    """Whether anything in ``config`` (a ``*dropout*`` field) or ``model`` (an
    ``nn.Dropout``, an ``attention_dropout``) is above 0."""
    for k, v in config.to_dict().items():
        if "dropout" in k and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            return True
    for m in (model.modules() if model is not None else ()):
        p = m.p if isinstance(m, nn.Dropout) else getattr(m, "attention_dropout", 0.0)
        if isinstance(p, (int, float)) and p > 0:
            return True
    return False


def keyed_reference(model: nn.Module) -> None:
    """``keyed`` for the whole single-process model: an attention module (it has
    ``head_dim`` and ``num_key_value_groups``, as ``hf_plan`` tells them) holds every
    query head."""
    n_heads = int(model.config.num_attention_heads)

    def heads_of(_path: str, m: nn.Module) -> tuple[int, ...] | None:
        attn = hasattr(m, "head_dim") and hasattr(m, "num_key_value_groups")
        return tuple(range(n_heads)) if attn else None

    keyed(model, heads_of)
