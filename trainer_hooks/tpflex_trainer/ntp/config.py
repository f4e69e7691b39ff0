"""The small GPT's configuration and the canonical description of its parameters.

Every sharded parameter is stored *unit-major along axis 0*: unit u of a parameter is the
row block ``[u * unit_rows, (u + 1) * unit_rows)`` of its full (canonical) tensor, and a
member's local tensor is the concatenation of its units' blocks in ascending unit order.
Row-parallel weights are therefore stored transposed (``weight_t``: [in, out]). Pure: no
torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from tpflex_trainer.ntp.errors import ConfigError
from tpflex_trainer.ntp.layout import check_partners

REPLICATED = "_replicated"  # pseudo-family of the parameters every member holds whole


@dataclass(frozen=True)
class GPTConfig:
    n_layers: int = 2
    hidden: int = 32
    n_heads: int = 8
    n_kv_groups: int = 4
    ffn_hidden: int = 64
    ffn_block: int = 8
    vocab: int = 64
    vocab_block: int = 8
    seq_len: int = 16

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ConfigError(f"{f.name} must be >= 1, got {getattr(self, f.name)}")
        checks = [
            (self.hidden % self.n_heads == 0, "hidden must be divisible by n_heads"),
            (self.n_heads % self.n_kv_groups == 0, "n_heads must be divisible by n_kv_groups"),
            (self.ffn_hidden % self.ffn_block == 0, "ffn_hidden must be divisible by ffn_block"),
            (self.vocab % self.vocab_block == 0, "vocab must be divisible by vocab_block"),
        ]
        for ok, why in checks:
            if not ok:
                raise ConfigError(f"{why}: {self}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def heads_per_group(self) -> int:
        return self.n_heads // self.n_kv_groups

    def unit_counts(self) -> dict[str, int]:
        """Units of each sharded family: attention by KV group (its query heads move with
        it), MLP by blocks of FFN columns, embedding/output by blocks of vocab rows."""
        return {
            "kv_groups": self.n_kv_groups,
            "ffn": self.ffn_hidden // self.ffn_block,
            "vocab": self.vocab // self.vocab_block,
        }

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]  # full canonical shape
    family: str  # a unit family, or REPLICATED
    unit_rows: int  # rows per unit along axis 0 (the whole first dim when replicated)
    init_std: float  # 0.0 means constant ``init_const``
    init_const: float = 0.0
    # replicated, but each TP member only sees its slice of the activations (Qwen3's
    # per-head q_norm/k_norm): its gradient is partial and summed over the TP group first
    partial_grad: bool = False
    # the user's tensor is the canonical one transposed (a row-parallel weight)
    transposed: bool = False
    # a fused projection (GLM's gate_up_proj, Phi-3's qkv_proj): the user's rows are chunks
    # (gate, up; q, k, v), each unit-major with ``chunk_rows[c]`` rows per unit; a canonical
    # unit is its rows of every chunk in turn (``unit_rows`` = their sum). Empty: not fused
    chunk_rows: tuple[int, ...] = ()

    @property
    def sharded(self) -> bool:
        return self.family != REPLICATED

    @property
    def decay(self) -> bool:
        """AdamW decays parameters with 2+ dimensions only (not biases and norms)."""
        return len(self.shape) >= 2

    @property
    def user_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape)) if self.transposed else self.shape

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def unit_numel(self) -> int:
        return self.unit_rows * self.row_numel

    @property
    def n_units(self) -> int:
        return self.shape[0] // self.unit_rows


def to_user(spec: ParamSpec, canon):
    """The user's tensor (HF's layout) of a canonical one: chunks regrouped, transposed."""
    t = canon
    if spec.chunk_rows:
        units = t.reshape(spec.n_units, spec.unit_rows, *spec.shape[1:])
        t = torch_cat([c.reshape(-1, *spec.shape[1:]) for c in units.split(list(spec.chunk_rows), dim=1)])
    return t.t().contiguous() if spec.transposed else t.contiguous()


def to_canonical(spec: ParamSpec, user):
    """The canonical (unit-major) tensor of the user's one (``to_user`` inverted)."""
    t = user.t() if spec.transposed else user
    if spec.chunk_rows:
        n = spec.n_units
        parts = t.split([n * r for r in spec.chunk_rows])
        t = torch_cat([p.reshape(n, r, *spec.shape[1:]) for p, r in zip(parts, spec.chunk_rows, strict=True)],
                      dim=1).reshape(spec.shape)
    return t.contiguous()


def torch_cat(parts, dim: int = 0):
    import torch

    return torch.cat(parts, dim=dim)


def param_specs(cfg: GPTConfig) -> list[ParamSpec]:
    """All parameters in forward order (backward readiness is roughly the reverse)."""
    d, hd, hpg = cfg.hidden, cfg.head_dim, cfg.heads_per_group
    std, proj_std = 0.02, 0.02 / math.sqrt(2 * cfg.n_layers)
    specs = [
        ParamSpec("embed.weight", (cfg.vocab, d), "vocab", cfg.vocab_block, std),
        ParamSpec("pos.weight", (cfg.seq_len, d), REPLICATED, cfg.seq_len, std),
    ]
    for i in range(cfg.n_layers):
        p = f"h{i}."
        specs += [
            ParamSpec(p + "ln1.weight", (d,), REPLICATED, d, 0.0, 1.0),
            ParamSpec(p + "ln1.bias", (d,), REPLICATED, d, 0.0, 0.0),
            ParamSpec(p + "attn.qkv.weight", (cfg.n_kv_groups * (hpg + 2) * hd, d), "kv_groups", (hpg + 2) * hd, std),
            ParamSpec(p + "attn.proj.weight_t", (cfg.n_heads * hd, d), "kv_groups", hpg * hd, proj_std),
            ParamSpec(p + "ln2.weight", (d,), REPLICATED, d, 0.0, 1.0),
            ParamSpec(p + "ln2.bias", (d,), REPLICATED, d, 0.0, 0.0),
            ParamSpec(p + "mlp.fc.weight", (cfg.ffn_hidden, d), "ffn", cfg.ffn_block, std),
            ParamSpec(p + "mlp.proj.weight_t", (cfg.ffn_hidden, d), "ffn", cfg.ffn_block, proj_std),
        ]
    specs += [
        ParamSpec("lnf.weight", (d,), REPLICATED, d, 0.0, 1.0),
        ParamSpec("lnf.bias", (d,), REPLICATED, d, 0.0, 0.0),
        ParamSpec("head.weight", (cfg.vocab, d), "vocab", cfg.vocab_block, std),
    ]
    check_partners(partner_pairs(specs))
    return specs


def partner_pairs(specs: list[ParamSpec]) -> list[tuple[str, int, str, int]]:
    """(column weight, its units, row-parallel partner, its units) for every pair."""
    by_name = {s.name: s for s in specs}
    pairs = []
    for s in specs:
        for col, row in (("attn.qkv.weight", "attn.proj.weight_t"), ("mlp.fc.weight", "mlp.proj.weight_t")):
            if s.name.endswith(col):
                partner = by_name[s.name[: -len(col)] + row]
                pairs.append((s.name, s.n_units, partner.name, partner.n_units))
    return pairs


