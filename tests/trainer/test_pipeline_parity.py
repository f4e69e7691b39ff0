"""Pipeline stages under NTP, trained by ``tpflex-train --pp P`` (real gloo processes,
1F1B over micro-batches, activations exchanged between stages of different TP degrees)
against the HF model in one process: per-step loss and global gradient norm within 1e-5
relative, final weights within 1e-5 relative L2, through a drain, a kill and a repair of
slots of single stages. Reshard traffic is checked per stage: only the stage concerned
moves units, a killed member's units come from the same stage of the other replica, and
the bytes equal a bound computed from the config shapes."""

from __future__ import annotations

import pytest
from tpflex_trainer.ntp.hf_adapter import HfAdapter
from transformers import AutoConfig

from tests.trainer.hf_support import (
    args,
    make_data,
    make_model_dir,
    parity_failures,
    reference_for,
    train,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def unit_bytes(config, counts: dict[str, int], layers: int, qkv_bias: bool = False) -> dict[str, int]:
    """Bytes (weights + two Adam moments, fp32) of one unit of each family in a stage of
    ``layers`` decoder layers, from the HF config shapes: a KV group (its query heads, K
    and V head, o_proj columns, q/k/v biases), a block of MLP columns (gate, up, down), a
    block of vocab rows of the output layer."""
    h, hd = config.hidden_size, config.head_dim
    hpg = config.num_attention_heads // config.num_key_value_heads
    attn = h * hd * (2 * hpg + 2) + ((hpg + 2) * hd if qkv_bias else 0)
    return {"attn": 12 * layers * attn,
            "ffn": 12 * layers * 3 * h * (config.intermediate_size // counts["ffn"]),
            "vocab": 12 * h * (config.vocab_size // counts["vocab"])}


def replicated_bytes(config, layers: int, last: bool) -> int:
    """Bytes of a stage's replicated parameters (two norms per layer, the final norm)."""
    return 12 * config.hidden_size * (2 * layers + (1 if last else 0))


def senders(summary: dict, at: str) -> set[tuple[int, ...]]:
    return {tuple(r["member"]) for r in summary["reshards"] if r["at"] == at and r["bytes_sent"] > 0}


def wire(summary: dict) -> dict[str, int]:
    """Per reshard event, the bytes every member sent (counted at the send)."""
    out: dict[str, int] = {}
    for r in summary["reshards"]:
        if r["at"] != "start":
            out[r["at"]] = out.get(r["at"], 0) + r["bytes_sent"]
    return out


def reshard(summary: dict, at: str) -> dict:
    found = [r for r in summary["reshards"] if r["at"] == at]
    assert found and len({r["bytes_moved"] for r in found}) == 1, found
    return found[0]


def test_pp2_tp3_llama_drain_kill_repair(tmp_path):
    """2 replicas x 2 stages x TP 3: 4 KV groups on 3 and on 2 members; a drain in stage 0
    of replica 1 (its stage 1 keeps TP 3: a TP-2 stage sends to a TP-3 one), a kill in
    stage 1 of replica 0, both repaired. AdamW with decay, clipping that bites, warmup +
    cosine, 4 micro-batches (1F1B fills the pipeline)."""
    model = make_model_dir(tmp_path / "llama", "llama", heads=8, kv=4, layers=3)
    data = make_data(tmp_path / "tokens.npy")
    argv = args(model, data, tmp_path / "out", tp=3, pp=2, steps=8, micro_batches=4,
                events="2:drain=1:0:2,3:kill=0:1:1,5:undrain=1:0:2,6:undrain=0:1:1",
                warmup=2, weight_decay=0.1, clip_grad=0.5, betas="0.9,0.95")
    summary = train(argv)
    ref = reference_for(argv)
    assert parity_failures(summary, ref, tmp_path / "out") == []
    assert any(n > 0.5 for n in ref["grad_norms"])  # clipping was active
    full = [[3, 3], [3, 3]]
    assert summary["degrees"] == [full] * 2 + [[[3, 3], [2, 3]]] + [[[3, 2], [2, 3]]] * 2 \
        + [[[3, 2], [3, 3]]] + [full] * 2
    cfg = AutoConfig.from_pretrained(model)
    counts = HfAdapter.from_pretrained_dir(model, 3).unit_counts
    unit = unit_bytes(cfg, counts, layers=1)  # stage 1: layer 2, the final norm, the output layer
    small = sum(unit[f] * (counts[f] // 3) for f in unit)  # TP rank 1 of 3 holds the smaller shares
    # the drain moves units inside stage 0 of replica 1 only
    assert senders(summary, "boundary 2") <= {(1, s, 0) for s in range(3)}
    assert senders(summary, "boundary 2")
    # the kill of (replica 0, slot 1, stage 1): exactly its units, from stage 1 of replica 1
    sent = wire(summary)  # bytes on the wire against bounds from the config shapes
    kill = reshard(summary, "recovery 3")
    assert sent["recovery 3"] == kill["bytes_moved"] == small  # exactly the lost member's units
    assert kill["peer_units"] > 0 and kill["source"] == "live"
    assert senders(summary, "recovery 3") <= {(1, s, 1) for s in range(3)}
    # the killed slot returns as a fresh process: at least one member's units and the
    # replicated parameters (t_min goes back from 2 to 3, so the core partitions realign and
    # more may move: seen 79488 B against 65664 for one larger share; not bounded above here)
    assert senders(summary, "boundary 6") <= {(r, s, 1) for r in range(2) for s in range(3)}
    rep = replicated_bytes(cfg, 1, True)
    assert small + rep <= sent["boundary 6"]
    for r in summary["reshards"]:  # the plan's figure agrees with the wire
        assert r["at"] == "start" or (r["source"] == "live" and r["bytes_moved"] == sent[r["at"]])


def test_pp3_tp2_qwen2_stages_at_different_degrees(tmp_path):
    """2 replicas x 3 stages x TP 2 (q/k/v biases, MHA): a kill in the middle stage of
    replica 1 while stage 0 of replica 0 is drained (three stages at degrees 1, 2, 2 in
    one replica, 2, 1, 2 in the other), both repaired; 3 micro-batches."""
    model = make_model_dir(tmp_path / "qwen2", "qwen2", heads=4, kv=4, layers=3)
    data = make_data(tmp_path / "tokens.npy")
    argv = args(model, data, tmp_path / "out", tp=2, pp=3, steps=7, micro_batches=3,
                events="2:drain=0:0:1,3:kill=1:1:0,5:undrain=0:0:1,6:undrain=1:1:0",
                weight_decay=0.1, clip_grad=1.0)
    summary = train(argv)
    assert parity_failures(summary, reference_for(argv), tmp_path / "out") == []
    assert summary["degrees"][3] == [[1, 2, 2], [2, 1, 2]]
    assert summary["degrees"][-1] == [[2, 2, 2], [2, 2, 2]]
    cfg = AutoConfig.from_pretrained(model)
    counts = HfAdapter.from_pretrained_dir(model, 2).unit_counts
    unit = unit_bytes(cfg, counts, layers=1, qkv_bias=True)  # the middle stage: layer 1 only
    kill = reshard(summary, "recovery 3")
    assert wire(summary)["recovery 3"] == kill["bytes_moved"] == sum(unit[f] * counts[f] // 2 for f in ("attn", "ffn"))
    assert senders(summary, "recovery 3") <= {(0, s, 1) for s in range(2)}
    assert senders(summary, "boundary 2") <= {(0, s, 0) for s in range(2)}
