"""Tiny Hugging Face models, token data and the parity check shared by the HF tests.

Models are built with ``from_config`` (no downloads) and saved with their weights (or
only their config.json). The parity check compares a ``tpflex-train`` output directory
with the HF model trained in one process (``hf_reference``): per-step loss and gradient
norm within 1e-5 relative, final weights (the exported directory loaded by
``from_pretrained``) within 1e-5 relative L2 over the whole model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch
from tpflex_trainer.ntp.hf_reference import ReferenceSettings, reference_run, relative_l2
from tpflex_trainer.train.cli import Launcher, build_spec

REL_TOL = 1e-5
VOCAB = 128
SEQ = 16


def make_model_dir(path: Path, family: str, *, heads: int = 8, kv: int = 4, tied: bool = False,
                   weights: bool = True, shard_bytes: int | None = None, seed: int = 0,
                   layers: int = 2, **config) -> Path:
    """``config``: more config fields (e.g. Granite's ``logits_scaling``, a ``pad_token_id``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        family, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=32 // heads,
        tie_word_embeddings=tied, max_position_embeddings=64, **config)
    path.mkdir(parents=True, exist_ok=True)
    if not weights:
        cfg.save_pretrained(path)
        return path
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    kwargs = {"max_shard_size": shard_bytes} if shard_bytes else {}
    model.save_pretrained(path, **kwargs)
    return path


def make_data(path: Path, rows: int = 64, seed: int = 0) -> Path:
    """Noisy arithmetic sequences (learnable: the loss falls)."""
    g = np.random.default_rng(seed)
    seq = (g.integers(0, VOCAB, (rows, 1)) + g.integers(1, 4, (rows, 1)) * np.arange(SEQ + 1)) % VOCAB
    noise = g.random(seq.shape) < 0.1
    seq = np.where(noise, g.integers(0, VOCAB, seq.shape), seq)
    np.save(path, seq.astype(np.int32))
    return path


def train(argv: list[str], env: dict[str, str] | None = None) -> dict:
    """Run ``tpflex-train`` in this process (workers forked from the forkserver); returns
    losses.json. ``env`` is set in the workers (test hooks)."""
    spec, model_type = build_spec(argv)
    if env:
        spec = dataclasses.replace(spec, env={**spec.env, **env})
    result = Launcher(spec, model_type).run()
    assert not result.error, result.error
    summary = result.summary()
    # replicas (and every copy of a replicated KV unit) hold bit-identical weights and
    # Adam state after the last step: peer recovery relies on it
    assert summary["units_checked"] > 0 and summary["units_disagreeing"] == [], summary["units_disagreeing"]
    (Path(spec.out) / "losses.json").write_text(json.dumps(summary))
    return summary


def reference_for(argv: list[str]) -> dict:
    spec, _ = build_spec(argv)
    s = spec.schedule
    settings = ReferenceSettings(
        steps=s.steps, global_batch=s.global_batch, lr=spec.adam.lr, betas=spec.adam.betas,
        eps=spec.adam.eps, weight_decay=spec.adam.weight_decay, clip_grad=spec.train.clip_grad,
        warmup=spec.train.schedule.warmup, min_lr_ratio=spec.train.schedule.min_lr_ratio,
        dtype="fp32", seed=spec.seed)
    return reference_run(spec.model, np.load(spec.data), settings)


def parity_failures(summary: dict, ref: dict, out: Path, tol: float = REL_TOL) -> list[str]:
    """Everything that breaks parity (empty when the run matches the reference)."""
    from transformers import AutoModelForCausalLM

    bad = []
    for name in ("losses", "grad_norms"):
        for step, (got, want) in enumerate(zip(summary[name], ref[name], strict=True)):
            if abs(got - want) > tol * abs(want):
                bad.append(f"{name}[{step}]: {got} vs reference {want}")
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    rel = relative_l2(dict(exported.state_dict()), ref["state"])
    if rel > tol:
        bad.append(f"final weights: relative L2 {rel:.3g}")
    return bad


def args(model: Path, data: Path, out: Path, **kw) -> list[str]:
    base = {"tp": 4, "replicas": 2, "global-batch": 8, "steps": 10, "lr": 3e-3,
            "collective-timeout": 60}
    base.update({k.replace("_", "-"): v for k, v in kw.items()})
    argv = ["--model", str(model), "--data", str(data), "--out", str(out)]
    for k, v in base.items():
        argv += [f"--{k}", str(v)]
    return argv
