"""Hugging Face models under NTP, trained by ``tpflex-train`` (real gloo processes),
against the HF model itself in one process with torch.optim.AdamW, clip_grad_norm_ and
the same schedule and data: per-step loss and gradient norm within 1e-5 relative, final
weights within 1e-5 relative L2, across drains, kills and repairs. Families: Llama (GQA,
4 KV groups on 3 members), Qwen3 (per-head q/k norms, tied, TP above the KV groups),
Qwen2 (q/k/v biases, MHA, no weights: seeded init), Mistral (GQA above the KV groups,
sharded safetensors, micro-batches). bf16 within 1% of fp32; a run with every sharded
gradient x3 fails the check."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.hf_support import (
    args,
    make_data,
    make_model_dir,
    parity_failures,
    reference_for,
    train,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def unit_payload_bytes(config, counts: dict[str, int], tied: bool) -> dict[str, int]:
    """Bytes of one unit (weights + two Adam moments, fp32) per family, from the HF config
    shapes (KV-group units: a group's query heads, its K and V head, o_proj columns)."""
    h, layers, hd = config.hidden_size, config.num_hidden_layers, config.head_dim
    hpg = config.num_attention_heads // config.num_key_value_heads
    attn = layers * h * (hpg * hd + hd + hd + hpg * hd)
    ffn = layers * 3 * h * (config.intermediate_size // counts["ffn"])
    vocab = (1 if tied else 2) * h * (config.vocab_size // counts["vocab"])
    return {f: 12 * n for f, n in {"attn": attn, "ffn": ffn, "vocab": vocab}.items()}


def reshards(summary: dict, at: str) -> list[dict]:
    return [r for r in summary["reshards"] if r["at"] == at]


def test_llama_gqa_kill_drain_repair(tmp_path):
    """4 KV groups on 3 members (a degree that does not divide them); AdamW with weight
    decay, clipping that bites, warmup + cosine, 2 micro-batches."""
    from tpflex_trainer.ntp.hf_adapter import HfAdapter
    from transformers import AutoConfig

    model = make_model_dir(tmp_path / "llama", "llama", heads=8, kv=4)
    data = make_data(tmp_path / "tokens.npy")
    argv = args(model, data, tmp_path / "out", steps=12, events="3:kill=0:3,6:drain=1:2,8:undrain=1:2,10:undrain=0:3",
                warmup=2, min_lr_ratio=0.1, weight_decay=0.1, clip_grad=0.5, betas="0.9,0.95", micro_batches=2)
    summary = train(argv)
    ref = reference_for(argv)
    assert parity_failures(summary, ref, tmp_path / "out") == []
    assert any(n > 0.5 for n in ref["grad_norms"])  # clipping was active
    assert summary["degrees"] == [[4, 4]] * 3 + [[3, 4]] * 3 + [[3, 3]] * 2 + [[3, 4]] * 2 + [[4, 4]] * 2
    assert ref["losses"][-1] < ref["losses"][0]
    # reshard traffic against bounds computed from the unit counts and the config shapes
    counts = HfAdapter.from_pretrained_dir(model, 4).unit_counts
    unit = unit_payload_bytes(AutoConfig.from_pretrained(model), counts, tied=False)
    one_member = sum(unit[f] * counts[f] // 4 for f in unit)  # a member of a uniform TP-4 replica
    kill = reshards(summary, "recovery 3")
    assert {r["bytes_moved"] for r in kill} == {one_member}  # exactly the lost member's units
    assert all(r["peer_units"] > 0 and r["source"] == "live" for r in kill)
    replicated = 12 * sum(t.numel() for n, t in load_file(model / "model.safetensors").items() if t.ndim == 1)
    # every reshard's bytes on the wire (counted at the send) against what the change made
    # move, from the config shapes: the lost member's units (kill 0:3), a returning slot's
    # units plus the replicated parameters (it comes back holding nothing)
    wanted = {"recovery 3": one_member, "boundary 8": one_member + replicated, "boundary 10": one_member + replicated}
    sent = {at: {tuple(r["member"][:2]): r["bytes_sent"] for r in reshards(summary, at)}
            for at in {r["at"] for r in summary["reshards"]} - {"start"}}
    assert set(sent) == {*wanted, "boundary 6"}
    assert {at: sum(sent[at].values()) for at in wanted} == wanted
    # drain 1:2 (a core rank) takes replica 1 to TP 3 = t_min: the drained member sends its
    # whole share; the extra (slot 3) becomes core rank 2, which holds partition 2 exactly, so
    # it may pass on its own units, at most its share; nobody else sends anything
    drain = sent["boundary 6"]
    assert drain[(1, 2)] == one_member and drain[(1, 3)] <= one_member
    assert sum(drain.values()) == drain[(1, 2)] + drain[(1, 3)]
    for r in summary["reshards"]:
        assert r["source"] == "live" or r["at"] == "start"
        assert r["at"] == "start" or r["bytes_moved"] == sum(sent[r["at"]].values())  # the plan's figure agrees


def test_qwen3_tied_tp_above_the_kv_groups(tmp_path):
    """2 KV groups, base TP 4: query-head units, KV heads replicated across members; the
    per-head q_norm/k_norm gradients are partial sums over the TP group."""
    model = make_model_dir(tmp_path / "qwen3", "qwen3", heads=8, kv=2, tied=True)
    data = make_data(tmp_path / "tokens.npy")
    argv = args(model, data, tmp_path / "out", steps=9, events="2:drain=0:1,4:kill=1:2,7:undrain=0:1",
                warmup=1, weight_decay=0.1, clip_grad=1.0)
    summary = train(argv)
    assert parity_failures(summary, reference_for(argv), tmp_path / "out") == []
    assert summary["degrees"][5] == [3, 3]
    files = json.loads((tmp_path / "out" / "losses.json").read_text())
    assert files["losses"] == summary["losses"]
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert "lm_head.weight" not in exported  # tied: one tensor, from_pretrained ties it


def test_qwen2_mha_biases_without_weights(tmp_path):
    """MHA with q/k/v biases; a model directory with only config.json (seeded init)."""
    model = make_model_dir(tmp_path / "qwen2", "qwen2", heads=4, kv=4, weights=False)
    data = make_data(tmp_path / "tokens.npy")
    argv = args(model, data, tmp_path / "out", tp=2, steps=8, events="3:drain=1:1,6:undrain=1:1",
                weight_decay=0.1, seed=3)
    summary = train(argv)
    assert parity_failures(summary, reference_for(argv), tmp_path / "out") == []
    assert summary["degrees"][3] == [2, 1]


def test_mistral_sharded_weights_above_the_kv_groups(tmp_path):
    """8 query heads on 3 members sharing 2 KV heads, one replica, weights in a sharded
    safetensors index, gradient accumulation over 2 micro-batches, then a drain to 2."""
    model = make_model_dir(tmp_path / "mistral", "mistral", heads=8, kv=2, shard_bytes=40_000)
    assert (model / "model.safetensors.index.json").exists()
    data = make_data(tmp_path / "tokens.npy")
    argv = args(model, data, tmp_path / "out", tp=3, replicas=1, steps=8, events="4:drain=0:2",
                micro_batches=2, clip_grad=1.0, warmup=2)
    summary = train(argv)
    assert parity_failures(summary, reference_for(argv), tmp_path / "out") == []
    assert summary["degrees"][3:5] == [[3], [2]]


def test_bf16_loss_within_one_percent_of_fp32(tmp_path):
    model = make_model_dir(tmp_path / "llama", "llama", heads=8, kv=4)
    data = make_data(tmp_path / "tokens.npy")
    argv = args(model, data, tmp_path / "out", tp=2, steps=6, dtype="bf16") + ["--no-export"]
    summary = train(argv)
    ref = reference_for(argv)  # fp32
    for got, want in zip(summary["losses"], ref["losses"], strict=True):
        assert abs(got - want) <= 0.01 * want, (got, want)
    assert summary["losses"] != pytest.approx(ref["losses"], rel=1e-6)  # it really ran in bf16


def test_a_run_with_sharded_gradients_times_3_fails_parity(tmp_path):
    """Adam hides a uniform gradient scale in the losses; the check looks at gradients
    and weights, so a broken sync must fail it."""
    model = make_model_dir(tmp_path / "llama", "llama", heads=8, kv=4)
    data = make_data(tmp_path / "tokens.npy")
    argv = args(model, data, tmp_path / "out", tp=2, steps=4)
    summary = train(argv, env={"TPFLEX_TEST_SHARDED_GRAD_SCALE": "3"})
    failures = parity_failures(summary, reference_for(argv), tmp_path / "out")
    assert any(f.startswith("grad_norms") for f in failures), failures
    assert torch.isfinite(torch.tensor(summary["losses"])).all()


def test_the_console_entry_point_writes_losses_and_the_model(tmp_path, capsys):
    from tpflex_trainer.train.cli import main

    model = make_model_dir(tmp_path / "qwen2", "qwen2", heads=4, kv=2)
    data = make_data(tmp_path / "tokens.npy")
    argv = args(model, data, tmp_path / "out", tp=2, replicas=1, steps=3, events="2:drain=0:1")
    assert main(argv) == 0
    out = json.loads((tmp_path / "out" / "losses.json").read_text())
    assert len(out["losses"]) == 3 and out["degrees"] == [[2], [2], [1]]
    assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "out").iterdir()}
    assert "3 steps" in capsys.readouterr().out
