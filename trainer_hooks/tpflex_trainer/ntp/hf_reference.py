"""The single-process reference for Hugging Face models: the user's model itself (HF's
own forward), ``torch.optim.AdamW`` (decay on 2+-dim parameters), ``clip_grad_norm_``
and a ``LambdaLR`` with the documented warmup + cosine formula, on the same global batches
as ``tpflex-train``. Parity tests and the demo compare NTP runs against it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ReferenceSettings:
    steps: int
    global_batch: int
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_grad: float = 0.0
    warmup: int = 0
    min_lr_ratio: float = 0.0
    dtype: str = "fp32"
    seed: int = 0


def lr_lambda(s: ReferenceSettings):
    def factor(step: int) -> float:
        if step < s.warmup:
            return (step + 1) / s.warmup
        progress = min(1.0, (step - s.warmup) / max(1, s.steps - s.warmup))
        return s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def load_reference_model(model_dir: str, seed: int = 0):
    """The user's model in one process: from its safetensors, or (a directory without
    weights) with the same seeded initial tensors the NTP runtime starts from."""
    from transformers import AutoModelForCausalLM

    from tpflex_trainer.ntp.hf_adapter import HfAdapter, lm_from_config, load_config
    from tpflex_trainer.ntp.hf_io import has_weights

    if has_weights(model_dir):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    else:
        config = load_config(model_dir)
        model = lm_from_config(config, dtype=torch.float32)
        model.load_state_dict(HfAdapter(config, 1, self_test=False).full_state(seed), strict=False)
    return model


def reference_run(model_dir: str, data: np.ndarray, s: ReferenceSettings) -> dict:
    """Train on ``tpflex-train``'s batches of ``data``; returns per-step losses and gradient
    norms (before clipping) and the final state dict."""
    n = data.shape[0]

    def batches():
        for step in range(s.steps):
            rows = np.asarray(data[[(step * s.global_batch + i) % n for i in range(s.global_batch)]], dtype=np.int64)
            rows = torch.from_numpy(rows)
            yield rows[:, :-1], rows[:, 1:]

    return reference_train(load_reference_model(model_dir, s.seed), batches(), s)


def reference_train(model, batches, s: ReferenceSettings) -> dict:
    """Train ``model`` on each global (inputs, labels) batch in turn, in training mode,
    its dropout masks keyed as the NTP runtime keys them (``dropout``: by seed, step,
    sample, module and query head), so both draw the same masks."""
    from tpflex_trainer.ntp import dropout
    from tpflex_trainer.ntp.hf_adapter import keyed_reference

    model.train()
    keyed_reference(model)
    params = [p for p in model.parameters()]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": s.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=s.lr, betas=s.betas, eps=s.eps, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(s))
    losses, norms = [], []
    for step, (inputs, labels) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.dtype == "bf16"), \
                dropout.scope(s.seed, step, 0, inputs.shape[0], int(model.config.hidden_size)):
            logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        max_norm = s.clip_grad if s.clip_grad > 0 else float("inf")
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        opt.step()
        sched.step()
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def relative_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """sqrt(sum ||a - b||²) / sqrt(sum ||b||²) over the tensors of ``b`` (the reference)."""
    num = sum(float((a[k].float() - v.float()).pow(2).sum()) for k, v in b.items())
    den = sum(float(v.float().pow(2).sum()) for v in b.values())
    return math.sqrt(num / den)
