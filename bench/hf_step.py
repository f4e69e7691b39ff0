"""A Llama-shaped Hugging Face model (>= 50 M parameters) under NTP on CPU (gloo):
step time of one dense process with torch.optim.AdamW, of the job at uniform TP 4+4 and at
nonuniform TP 4+3 (``tpflex-train``, slot 3 of replica 1 drained before step 1), the
healthy replica's step-time ratio (nonuniform vs uniform), the gradient bytes its TP group
moved in the last step (both directions, counted at the send: the tensors each member
handed to the pre- and post-sync all_to_all, ``GradSync.moved_bytes``) against a lower
bound computed here from the unit counts and the config shapes, the safetensors load into the
layout (slices per member) and the export to a HF directory.

On this machine (2 shared cores, 8 processes) compute is time-shared, so the step times
measure the runtime's overheads more than NVLink-era speed; at 4+3 one process fewer
competes for the cores. Prints one JSON line.
Run: PYTHONPATH=. .venv/bin/python bench/hf_step.py [--steps N]
(``--quick``: a 2-layer Llama of hidden 64 at TP 2+2 and 2+1, 1 measured step, the same
keys, seconds; for the test suite, its figures are not the measurement's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

CONFIG = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
              num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=False,
              max_position_embeddings=256)
QUICK_CONFIG = dict(CONFIG, vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    head_dim=8, max_position_embeddings=64)
SEQ, GLOBAL_BATCH, TP = 64, 8, 4


def make_model(root: Path, config: dict = CONFIG) -> tuple[Path, Path, int]:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", **config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(root / "model")
    rng = np.random.default_rng(0)
    np.save(root / "tokens.npy", rng.integers(0, config["vocab_size"], (64, SEQ + 1)).astype(np.int32))
    return root / "model", root / "tokens.npy", sum(p.numel() for p in model.parameters())


def dense_step_s(model_dir: Path, data: Path, steps: int) -> float:
    import torch.nn.functional as F
    from tpflex_trainer.ntp.hf_reference import load_reference_model

    torch.set_num_threads(2)
    model = load_reference_model(str(model_dir))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    rows = torch.from_numpy(np.load(data)[:GLOBAL_BATCH].astype(np.int64))
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad()
        logits = model(input_ids=rows[:, :-1]).logits
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def ntp_run(model_dir: Path, data: Path, out: Path, steps: int, events: str, tp: int = TP) -> dict:
    from tpflex_trainer.train.cli import Launcher, build_spec

    argv = ["--model", str(model_dir), "--data", str(data), "--out", str(out), "--tp", str(tp),
            "--replicas", "2", "--global-batch", str(GLOBAL_BATCH), "--steps", str(steps),
            "--lr", "1e-4", "--events", events, "--collective-timeout", "600"]
    spec, model_type = build_spec(argv)
    result = Launcher(spec, model_type).run()
    if result.error:
        raise RuntimeError(result.error)
    return {"summary": result.summary(), "grad_bytes": result.grad_bytes, "export_s": result.export_s}


def healthy_step_s(run: dict, first: int) -> float:
    seconds = run["summary"]["step_seconds"]["0"]
    return statistics.median(s for s in seconds[first:] if s is not None)


def grad_bytes_lower_bound(config: dict, unit_counts: dict[str, int], degree: int, t_min: int) -> int:
    """Fewest gradient bytes a replica at ``degree`` moves in its TP group per step when the
    job's smallest degree is ``t_min``: every unit that no balanced layout can keep on a
    core rank goes to a core and back (two directions), and the replicated gradients
    (norms, plus the loss) go to each extra rank once."""
    h, layers, hd = config["hidden_size"], config["num_hidden_layers"], config["head_dim"]
    hpg = config["num_attention_heads"] // config["num_key_value_heads"]
    unit_numel = {
        "attn": layers * h * (2 * hpg * hd + 2 * hd),
        "ffn": layers * 3 * h * config["intermediate_size"] // unit_counts["ffn"],
        "vocab": 2 * h * config["vocab_size"] // unit_counts["vocab"],
    }
    total = 0
    for fam, n in unit_counts.items():
        sizes = sorted((n // degree + (i < n % degree) for i in range(degree)), reverse=True)
        parts = sorted((n // t_min + (i < n % t_min) for i in range(t_min)), reverse=True)
        off_core = n - sum(min(parts[p], sizes[p]) for p in range(t_min))
        total += 2 * 4 * off_core * unit_numel[fam]
    replicated = layers * 2 * h + h + 1
    return total + (degree - t_min) * 4 * replicated


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6, help="measured steps per configuration")
    p.add_argument("--rounds", type=int, default=1,
                   help="alternate the uniform and nonuniform runs this many times (medians)")
    p.add_argument("--quick", action="store_true",
                   help="a 2-layer Llama of hidden 64 at TP 2, 1 measured step, 1 round (the same JSON keys)")
    a = p.parse_args(argv)
    config, tp = (QUICK_CONFIG, 2) if a.quick else (CONFIG, TP)
    if a.quick:
        a.steps, a.rounds = 1, 1
    from tpflex_trainer.ntp.hf_adapter import HfAdapter

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir, data, params = make_model(root, config)
        dense = dense_step_s(model_dir, data, a.steps)
        u_times, n_times = [], []
        for r in range(a.rounds):  # alternated: load from other processes hits both alike
            uniform = ntp_run(model_dir, data, root / f"u{r}", a.steps + 1, "", tp)
            nonuniform = ntp_run(model_dir, data, root / f"n{r}", a.steps + 2, f"1:drain=1:{tp - 1}", tp)
            u_times.append(healthy_step_s(uniform, 1))
            n_times.append(healthy_step_s(nonuniform, 2))
        counts = HfAdapter.from_pretrained_dir(model_dir, tp).unit_counts
        moved = sum(b for m, b in nonuniform["grad_bytes"].items() if m[0] == 0)
        bound = grad_bytes_lower_bound(config, counts, tp, tp - 1)
        starts = [r for r in uniform["summary"]["reshards"] if r["at"] == "start"]
        load_s = max(r["phases"]["transfer_s"] for r in starts)
        u, n = statistics.median(u_times), statistics.median(n_times)
        print(json.dumps({
            "params": params,
            "dense_step_s": round(dense, 4),
            "uniform_step_s": round(u, 4),
            "nonuniform_step_s": round(n, 4),
            "step_time_ratio": round(n / u, 4),
            "grad_bytes_per_step": moved,
            "grad_bytes_lower_bound": bound,
            "bytes_ratio": round(moved / bound, 4),
            "load_s": round(load_s, 4),
            "export_s": round(uniform["export_s"], 4),
        }))


if __name__ == "__main__":
    main()
