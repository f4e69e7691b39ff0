"""The demo's model and optimizer settings (shared by the workers and the reference run):
the built-in GPT, or a Hugging Face model directory (``tpflex-demo --model DIR``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from tpflex_trainer.ntp.config import GPTConfig
from tpflex_trainer.ntp.optim import AdamSettings

DEMO_MODEL = GPTConfig(
    n_layers=2, hidden=64, n_heads=8, n_kv_groups=8, ffn_hidden=256, ffn_block=16,
    vocab=128, vocab_block=8, seq_len=32,
)
DEMO_ADAM = AdamSettings(lr=3e-3)
DEMO_SEED = 7
LOCAL_BATCH = 4
HF_SEQ_LEN = 32
BASE_TP = 4


class _Shape(NamedTuple):  # what demo.data.global_batch reads from a model
    vocab: int
    seq_len: int


@dataclass(frozen=True)
class DemoModel:
    model: Any  # a GPTConfig, or a HF model directory (str)
    units: dict[str, int]
    shape: Any

    def batch(self, step: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        from tpflex_trainer.demo.data import global_batch

        return global_batch(self.shape, step, samples)

    def reference(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        """Losses of the same model trained in one process on ``batches``."""
        if isinstance(self.model, GPTConfig):
            from tpflex_trainer.ntp.reference import reference_losses

            return reference_losses(self.model, DEMO_SEED, batches, lr=DEMO_ADAM.lr,
                                    betas=DEMO_ADAM.betas, eps=DEMO_ADAM.eps)
        from tpflex_trainer.ntp.hf_reference import (
            ReferenceSettings,
            load_reference_model,
            reference_train,
        )

        s = ReferenceSettings(steps=len(batches), global_batch=0, lr=DEMO_ADAM.lr, betas=DEMO_ADAM.betas,
                              eps=DEMO_ADAM.eps, min_lr_ratio=1.0, seed=DEMO_SEED)
        return reference_train(load_reference_model(self.model, DEMO_SEED), batches, s)["losses"]


def demo_model(model_dir: str | None = None, base_tp: int = BASE_TP) -> DemoModel:
    """``base_tp``: the job's base TP degree (a Hugging Face model's unit counts depend
    on it, and the trainers register the counts their adapter derives at the spec's)."""
    if not model_dir:
        return DemoModel(DEMO_MODEL, DEMO_MODEL.unit_counts(), DEMO_MODEL)
    from tpflex_trainer.ntp.hf_adapter import HfAdapter

    adapter = HfAdapter.from_pretrained_dir(model_dir, base_tp)
    return DemoModel(str(model_dir), dict(adapter.unit_counts), _Shape(adapter.vocab, HF_SEQ_LEN))


BatchFn = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
