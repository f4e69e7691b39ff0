"""Deterministic synthetic training data: the same global batch for a step on every rank
and in the single-process reference run."""

from __future__ import annotations

import torch


def global_batch(cfg, step: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy arithmetic token sequences (learnable, so the loss falls visibly); ``cfg`` has
    ``vocab`` and ``seq_len`` (a ``GPTConfig`` or the demo's HF model shape)."""
    gen = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, cfg.vocab, (samples, 1), generator=gen)
    stride = torch.randint(1, 4, (samples, 1), generator=gen)
    seq = (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab
    noise = torch.rand(seq.shape, generator=gen) < 0.1
    seq = torch.where(noise, torch.randint(0, cfg.vocab, seq.shape, generator=gen), seq)
    return seq[:, :-1], seq[:, 1:]
