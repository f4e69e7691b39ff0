"""AdamW on the unit-sharded state, the LR schedule and the training settings.

The update has the arithmetic of ``torch.optim.AdamW``'s single-tensor path (decoupled
weight decay ``param *= 1 - lr * weight_decay`` first, then Adam; with
``weight_decay=0`` it is ``torch.optim.Adam``), applied to the member's state tensors in
place; kept here so that the moments live in ``LocalState`` (resharded with the weights)
and so that a fresh process does not import torch._dynamo (seconds of start-up) to build
one. The learning rate is a function of the state's step, so the schedule moves with the
state on a reshard.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tpflex_trainer.ntp.state import LocalState


@dataclass(frozen=True)
class AdamSettings:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0  # decoupled (AdamW), on parameters with 2+ dimensions only


@dataclass(frozen=True)
class WarmupCosine:
    """lr·(s+1)/warmup while s < warmup, then a cosine from lr to lr·min_lr_ratio over the
    remaining steps: lr_min + (lr - lr_min)·(1 + cos(π·(s - warmup)/(steps - warmup)))/2
    (s is the 0-based step)."""

    steps: int
    warmup: int = 0
    min_lr_ratio: float = 0.0

    def factor(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        span = max(1, self.steps - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class TrainSettings:
    """What a step does beyond forward/backward/Adam."""

    clip_grad: float = 0.0  # max global 2-norm (torch clip_grad_norm_ semantics); 0 = off
    schedule: WarmupCosine | None = None  # None: constant lr
    micro_batches: int = 1  # gradient accumulation; sync once per step after the last
    dtype: str = "fp32"  # "bf16": autocast with fp32 master weights, grads and Adam state

    def __post_init__(self) -> None:
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype must be fp32 or bf16, got {self.dtype!r}")
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches}")

    def lr_factor(self, step: int) -> float:
        return 1.0 if self.schedule is None else self.schedule.factor(step)


@torch.no_grad()
def adam_step(
    state: LocalState,
    grads: dict[str, torch.Tensor],
    settings: AdamSettings,
    lr: float | None = None,
    decay: Mapping[str, bool] | None = None,
) -> None:
    """One AdamW update of every parameter in ``grads`` at learning rate ``lr`` (default
    ``settings.lr``); ``decay[name]`` says whether weight decay applies. Increments
    ``state.step``."""
    lr = settings.lr if lr is None else lr
    state.step += 1
    beta1, beta2 = settings.betas
    bias_correction1 = 1 - beta1**state.step
    bias_correction2_sqrt = (1 - beta2**state.step) ** 0.5
    step_size = lr / bias_correction1
    for name, grad in grads.items():
        param = state.tensors["param"][name]
        exp_avg = state.tensors["exp_avg"][name]
        exp_avg_sq = state.tensors["exp_avg_sq"][name]
        if settings.weight_decay and (decay is None or decay.get(name, False)):
            param.mul_(1 - lr * settings.weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(settings.eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)
