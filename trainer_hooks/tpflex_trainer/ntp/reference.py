"""The single-process dense reference the parity tests compare against: plain tensors in
the canonical (unsharded) layout, explicit attention, ``torch.optim.Adam``."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from tpflex_trainer.ntp.config import GPTConfig, param_specs
from tpflex_trainer.ntp.state import full_init


def reference_params(cfg: GPTConfig, seed: int) -> dict[str, torch.Tensor]:
    return {s.name: full_init(s, seed).requires_grad_(True) for s in param_specs(cfg)}


def _attention(cfg: GPTConfig, p: dict[str, torch.Tensor], n: str, x: torch.Tensor) -> torch.Tensor:
    b, s, _ = x.shape
    g, hpg, hd = cfg.n_kv_groups, cfg.heads_per_group, cfg.head_dim
    qkv = (x @ p[n + "attn.qkv.weight"].T).view(b, s, g, hpg + 2, hd)
    q = qkv[:, :, :, :hpg].permute(0, 2, 3, 1, 4)  # b g h s d
    k = qkv[:, :, :, hpg].permute(0, 2, 1, 3).unsqueeze(2)  # b g 1 s d
    v = qkv[:, :, :, hpg + 1].permute(0, 2, 1, 3).unsqueeze(2)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    att = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    out = (att @ v).permute(0, 3, 1, 2, 4).reshape(b, s, g * hpg * hd)
    return out @ p[n + "attn.proj.weight_t"]


def reference_loss(cfg: GPTConfig, p: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    x = p["embed.weight"][tokens] + p["pos.weight"][: tokens.shape[1]]
    d = (cfg.hidden,)
    for i in range(cfg.n_layers):
        n = f"h{i}."
        x = x + _attention(cfg, p, n, F.layer_norm(x, d, p[n + "ln1.weight"], p[n + "ln1.bias"]))
        h = F.layer_norm(x, d, p[n + "ln2.weight"], p[n + "ln2.bias"])
        x = x + F.gelu(h @ p[n + "mlp.fc.weight"].T) @ p[n + "mlp.proj.weight_t"]
    x = F.layer_norm(x, d, p["lnf.weight"], p["lnf.bias"])
    logits = x @ p["head.weight"].T
    return F.cross_entropy(logits.reshape(-1, cfg.vocab), targets.reshape(-1))


def reference_run(
    cfg: GPTConfig,
    seed: int,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> tuple[list[float], list[float], dict[str, dict[str, torch.Tensor]]]:
    """Train on each (tokens, targets) global batch in turn. Returns the loss before each
    update, the global 2-norm of each step's gradients (what the job's ``grad_norm``
    computes, before any clipping) and the final state as ``read_full_state`` gives a
    job's: {"param"/"exp_avg"/"exp_avg_sq": {name: tensor}}."""
    params = reference_params(cfg, seed)
    opt = torch.optim.Adam(params.values(), lr=lr, betas=betas, eps=eps, foreach=False)
    losses, norms = [], []
    for tokens, targets in batches:
        opt.zero_grad(set_to_none=True)
        loss = reference_loss(cfg, params, tokens, targets)
        loss.backward()
        norms.append(math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params.values())))
        opt.step()
        losses.append(loss.item())
    state = {"param": {n: p.detach().clone() for n, p in params.items()}}
    for kind in ("exp_avg", "exp_avg_sq"):
        state[kind] = {n: opt.state[p][kind].detach().clone() for n, p in params.items()}
    return losses, norms, state


def reference_losses(
    cfg: GPTConfig,
    seed: int,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> list[float]:
    """Train on each (tokens, targets) global batch in turn; the loss before each update."""
    return reference_run(cfg, seed, batches, lr, betas, eps)[0]


def reference_state(
    cfg: GPTConfig,
    seed: int,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> tuple[list[float], dict[str, dict[str, torch.Tensor]]]:
    """Like ``reference_losses``, plus the final state (``reference_run``)."""
    losses, _, state = reference_run(cfg, seed, batches, lr, betas, eps)
    return losses, state


def state_rel_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over every tensor of ``b`` (the whole model), in float64."""
    diff = sum(float((a[n].double() - t.double()).pow(2).sum()) for n, t in b.items())
    norm = sum(float(t.double().pow(2).sum()) for t in b.values())
    return math.sqrt(diff / max(norm, 1e-300))
