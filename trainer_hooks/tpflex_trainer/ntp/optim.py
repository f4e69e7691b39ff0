"""Adam on the unit-sharded state. The same arithmetic as ``torch.optim.Adam``'s
single-tensor path (no weight decay), applied to the member's state tensors in place;
kept here so that the moments live in ``LocalState`` (resharded with the weights) and so
that a fresh process does not import torch._dynamo (seconds of start-up) to build one."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpflex_trainer.ntp.state import LocalState


@dataclass(frozen=True)
class AdamSettings:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


@torch.no_grad()
def adam_step(state: LocalState, grads: dict[str, torch.Tensor], settings: AdamSettings) -> None:
    """One Adam update of every parameter in ``grads``; increments ``state.step``."""
    state.step += 1
    beta1, beta2 = settings.betas
    bias_correction1 = 1 - beta1**state.step
    bias_correction2_sqrt = (1 - beta2**state.step) ** 0.5
    step_size = settings.lr / bias_correction1
    for name, grad in grads.items():
        param = state.tensors["param"][name]
        exp_avg = state.tensors["exp_avg"][name]
        exp_avg_sq = state.tensors["exp_avg_sq"][name]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(settings.eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)
