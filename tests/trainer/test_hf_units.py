"""Pure parts of the HF path: replicated KV units in layouts and reshard plans (checked
against bounds computed independently from the unit assignment), the tp-plan mapping and
its refusals, the tpflex-train schedule and argument errors, safetensors slices and
export."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tpflex_trainer.ntp.config import ParamSpec
from tpflex_trainer.ntp.errors import UnsupportedModelError
from tpflex_trainer.ntp.layout import (
    Derived,
    Member,
    ReplicaPlacement,
    plan_layout,
    replica_traffic,
)
from tpflex_trainer.ntp.reshard_plan import plan_reshard
from tpflex_trainer.train.schedule import ScheduleError, parse_events

from tests.trainer.hf_support import make_data, make_model_dir


@st.composite
def kv_jobs(draw):
    n_kv = draw(st.sampled_from([1, 2, 3, 4]))
    hpg = draw(st.sampled_from([2, 3, 4]))
    base_tp = draw(st.integers(n_kv + 1, min(8, n_kv * hpg)))
    replicas = draw(st.integers(1, 3))
    return n_kv, hpg, base_tp, replicas


def kv_of(heads, hpg) -> set[int]:
    return {h // hpg for h in heads}


@settings(max_examples=120, deadline=None)
@given(job=kv_jobs(), data=st.data())
def test_replicated_kv_units_follow_their_query_heads(job, data):
    n_kv, hpg, base_tp, n_rep = job
    counts = {"attn": n_kv * hpg, "ffn": 2 * base_tp}
    derived = {"kv": Derived("attn", hpg)}
    full = tuple(ReplicaPlacement(r, tuple(range(base_tp)), 1) for r in range(n_rep))
    old = plan_layout(counts, full, base_tp, derived=derived)
    r = data.draw(st.integers(0, n_rep - 1))
    gone = data.draw(st.integers(0, base_tp - 1))
    drained = tuple(ReplicaPlacement(p.replica, tuple(s for s in p.slots if (p.replica, s) != (r, gone)), 1)
                    for p in full)
    new = plan_layout(counts, drained, base_tp, previous=old, derived=derived)
    for lay in (old, new):
        for rep in lay.replicas:
            for m in rep.members:  # a member holds exactly the KV heads of its query heads
                assert set(m.units["kv"]) == kv_of(m.units["attn"], hpg)
            # gradient moves of the kv family: every copy held outside its reducer
            part = lay.partition_of("kv")
            brute = sum(1 for m in rep.members for g in m.units["kv"] if part[g] != m.tp_rank)
            assert replica_traffic(lay, rep.replica)["kv"] == brute
        assert sorted(g for p in lay.partitions["kv"] for g in p) == list(range(n_kv))
    # reshard: the departing member's query-head and FFN units, plus the KV copies members
    # did not hold before (an independent count over the two assignments)
    leaving = old.member(Member(r, gone))
    before = {m.member: m for m in old.members()}
    new_copies = sum(len(kv_of(m.units["attn"], hpg) - set(before[m.member].units["kv"]))
                     for m in new.members())
    primary = sum(len(leaving.units[f]) for f in ("attn", "ffn"))
    plan = plan_reshard(old, new, [m.member for m in old.members()])
    moved = {f: sum(1 for t in plan.transfers if t.family == f) for f in ("attn", "ffn", "kv")}
    assert moved["kv"] == new_copies
    assert moved["attn"] + moved["ffn"] >= primary
    divides = all(n % base_tp == 0 and n % (base_tp - 1) == 0 for n in counts.values())
    if n_rep == 1 or divides:
        # otherwise a healthy replica may move one more unit from its new extra rank to a
        # core: the layout keeps the per-step gradient traffic at its minimum
        assert moved["attn"] + moved["ffn"] == primary
    assert not plan.missing


def test_tp_plan_mapping_and_refusals():
    from tpflex_trainer.ntp.hf_adapter import HfAdapter
    from transformers import AutoConfig

    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    ad = HfAdapter(AutoConfig.for_model("qwen3", head_dim=4, **small), base_tp=2)
    kinds = {s.name.split(".", 3)[-1]: (s.family, s.unit_rows, s.partial_grad, s.transposed) for s in ad.specs}
    assert kinds["self_attn.q_proj.weight"] == ("attn", 8, False, False)  # a KV group: 2 heads x 4
    assert kinds["self_attn.o_proj.weight"] == ("attn", 8, False, True)
    assert kinds["self_attn.q_norm.weight"] == ("_replicated", 4, True, False)
    assert kinds["input_layernorm.weight"][2:] == (False, False)
    above = HfAdapter(AutoConfig.for_model("qwen3", head_dim=4, **small), base_tp=3)
    assert above.unit_counts["attn"] == 4 and above.derived == {"kv": Derived("attn", 2)}
    refused = {
        # GPT-NeoX's per-head fused q/k/v is multi-head only (the config's 2 KV heads are not its model's)
        ("gpt_neox", 2): "fused q/k/v by head is supported for multi-head attention",
        ("phi3", 3): "fused q/k/v above the KV heads",  # fused q/k/v: units by KV group only
    }
    for (family, base_tp), why in refused.items():
        cfg = AutoConfig.for_model(family, **small)
        with pytest.raises(UnsupportedModelError, match=why):
            HfAdapter(cfg, base_tp=base_tp)
    mha = {k: v for k, v in small.items() if k != "num_key_value_heads"}
    neox = HfAdapter(AutoConfig.for_model("gpt_neox", tie_word_embeddings=False, **mha), base_tp=2, self_test=False)
    names = {s.name: s for s in neox.specs}  # its own names: embed_in, layers, final_layer_norm
    assert names["gpt_neox.embed_in.weight"].family == names["lm_head.weight"].family == "vocab"
    qkv = names["gpt_neox.layers.0.attention.query_key_value.weight"]
    assert (qkv.family, qkv.unit_rows, qkv.chunk_rows) == ("attn", 12, ())  # one head's q, k, v rows in turn
    assert neox.place_of("gpt_neox.final_layer_norm.weight") == neox.place_of("lm_head.weight")
    fused = HfAdapter(AutoConfig.for_model("phi3", **small), base_tp=2)  # KV-group units: q, k, v rows
    qkv = next(s for s in fused.specs if s.name.endswith("layers.0.self_attn.qkv_proj.weight"))
    assert qkv.chunk_rows == (8, 4, 4) and qkv.unit_rows == 16
    # an embedding entry (transformers 5.17's Qwen3 plan) changes nothing: vocab-parallel anyway
    cfg = AutoConfig.for_model("qwen3", head_dim=4, **small)
    cfg.base_model_tp_plan = {"embed_tokens": "embedding_rowwise", **cfg.base_model_tp_plan}
    assert HfAdapter(cfg, base_tp=2).specs == ad.specs
    cfg.base_model_tp_plan = {**cfg.base_model_tp_plan, "embed_tokens": "colwise"}
    with pytest.raises(UnsupportedModelError, match="'colwise' of 'embed_tokens'"):
        HfAdapter(cfg, base_tp=2)
    cfg = AutoConfig.for_model("llama", **small)
    cfg.base_model_tp_plan = {**cfg.base_model_tp_plan, "layers.*.mlp.down_proj": "colwise"}
    with pytest.raises(UnsupportedModelError, match="exactly one row-parallel"):
        HfAdapter(cfg, base_tp=2)
    cfg = AutoConfig.for_model("llama", **small)
    cfg.base_model_tp_plan = {"layers.*.self_attn.qkv": "colwise", **cfg.base_model_tp_plan}
    with pytest.raises(UnsupportedModelError, match="match no module"):
        HfAdapter(cfg, base_tp=2)


def test_schedule_semantics_and_errors():
    s = parse_events("5:drain=1:2,9:kill=0:3,12:undrain=1:2,14:undrain=0:3", 4, 2, 20, 8)
    assert s.out_at(5) == {Member(1, 2)}
    assert s.out_at(9) == {Member(1, 2)} and s.out_after_kills(9) == {Member(1, 2), Member(0, 3)}
    assert s.out_at(12) == {Member(0, 3)}
    assert s.revived_at(14) == (Member(0, 3),) and s.revived_at(12) == ()
    assert Member(0, 3) not in s.alive_at(10) and Member(0, 3) in s.alive_at(14)
    assert [p.degree for p in s.placements(s.out_at(9))] == [4, 3]
    assert [p.local_batch for p in parse_events("", 4, 3, 5, 8).placements(frozenset())] == [3, 3, 2]
    bad = {
        "5:drain=2:0": "no replica 2",
        "5:undrain=0:1": "not out",
        "0:drain=0:1": "step must be",
        "3:drain=0:1,4:kill=0:1": "already out",
        "2:drain=0:0,3:drain=0:1,4:drain=0:2,5:drain=0:3": "no slot left",
        "5:explode=0:1": "not STEP",
    }
    for text, why in bad.items():
        with pytest.raises(ScheduleError, match=why):
            parse_events(text, 4, 2, 20, 8)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return make_model_dir(root / "llama", "llama", heads=8, kv=4), make_data(root / "tokens.npy")


@pytest.mark.parametrize("extra, named", [
    (["--tp", "0"], "--tp"),
    (["--tp", "9"], "--tp"),
    (["--events", "3:drain=7:0"], "--events"),
    (["--betas", "0.9"], "--betas"),
    (["--dtype", "fp16"], "--dtype"),
    (["--warmup", "50"], "--warmup"),
    (["--micro-batches", "9"], "--micro-batches"),
])
def test_bad_arguments_exit_2_naming_the_argument(llama_dir, tmp_path, capsys, extra, named):
    from tpflex_trainer.train.cli import main

    model, data = llama_dir
    with pytest.raises(SystemExit) as exc:
        main(["--model", str(model), "--data", str(data), "--out", str(tmp_path / "o"), "--steps", "10", *extra])
    assert exc.value.code == 2
    assert f"error: {named}:" in capsys.readouterr().err


def test_bad_model_and_data_exit_2(llama_dir, tmp_path, capsys):
    from tpflex_trainer.train.cli import main

    model, data = llama_dir
    np.save(tmp_path / "big.npy", np.full((4, 9), 500, dtype=np.int32))
    np.save(tmp_path / "floats.npy", np.zeros((4, 9), dtype=np.float32))
    cases = [(tmp_path / "nowhere", data, "--model"), (model, tmp_path / "big.npy", "--data"),
             (model, tmp_path / "floats.npy", "--data"), (model, tmp_path / "missing.npy", "--data")]
    for m, d, named in cases:
        with pytest.raises(SystemExit) as exc:
            main(["--model", str(m), "--data", str(d), "--out", str(tmp_path / "o")])
        assert exc.value.code == 2
        assert f"error: {named}:" in capsys.readouterr().err


def test_safetensors_rows_are_read_as_slices_and_export_round_trips(llama_dir, tmp_path):
    from safetensors.torch import load_file
    from tpflex_trainer.ntp.hf_adapter import HfAdapter
    from tpflex_trainer.ntp.hf_io import (
        SafetensorsReader,
        assemble,
        write_hf_dir,
        write_member_part,
    )
    from transformers import AutoModelForCausalLM

    model, _ = llama_dir
    ad = HfAdapter.from_pretrained_dir(model, 4)
    full = load_file(model / "model.safetensors")
    reader = SafetensorsReader(model)
    o = next(s for s in ad.specs if s.name.endswith("layers.0.self_attn.o_proj.weight"))
    rows = reader.rows(o, (1, 3))  # units 1 and 3: o_proj columns, transposed to unit-major rows
    r = o.unit_rows
    want = torch.cat([full[o.name][:, r:2 * r].t(), full[o.name][:, 3 * r:4 * r].t()])
    assert torch.equal(rows, want) and reader.bytes_read == want.numel() * 4  # only those rows
    # a two-member split of every unit, assembled and written, loads back identically
    layout = plan_layout(ad.unit_counts, (ReplicaPlacement(0, (0, 1)),), 4)
    parts = []
    for m in layout.members():
        units = {**m.units, "_replicated": (0,)}
        local = {s.name: reader.rows(s, tuple(units[s.family])) for s in ad.specs}
        parts.append(tmp_path / f"part{m.member.slot}.safetensors")
        write_member_part(parts[-1], ad.specs, units, local)
    tensors = assemble(ad.specs, parts)
    assert all(torch.equal(tensors[k], full[k]) for k in full)
    files = write_hf_dir(tmp_path / "export", ad.config, tensors, max_shard_bytes=30_000)
    assert "model.safetensors.index.json" in files and len(files) > 3
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).state_dict()
    assert all(torch.equal(loaded[k], full[k]) for k in full)
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model_type"] == "llama"


def test_param_spec_user_shape():
    spec = ParamSpec("o.weight", (8, 4), "attn", 2, 0.02, transposed=True)
    assert spec.user_shape == (4, 8) and spec.decay
    assert not ParamSpec("n.weight", (4,), "_replicated", 4, 0.0, 1.0).decay


def test_gradient_routes_move_exactly_the_copies_outside_their_reducers():
    """Qwen3 with 8 query heads and 2 KV heads at base TP 4, replicas at degrees 4 and 3:
    the blocks every member sends to a reducer (and gets back: both directions) are the
    units it holds outside their reducer, sized from the config shapes independently."""
    from tpflex_trainer.ntp.grad_routes import bucket_routes
    from tpflex_trainer.ntp.hf_adapter import HfAdapter
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("qwen3", vocab_size=64, hidden_size=16, intermediate_size=32,
                               num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                               head_dim=2, pad_token_id=0, tie_word_embeddings=False)
    ad = HfAdapter(cfg, base_tp=4)
    layout = plan_layout(ad.unit_counts, (ReplicaPlacement(0, (0, 1, 2, 3)), ReplicaPlacement(1, (0, 1, 3))),
                         4, derived=ad.derived)
    h, layers, hd = 16, 2, 2
    numel = {"attn": layers * 2 * hd * h, "kv": layers * 2 * hd * h,
             "ffn": layers * 3 * h * 32 // ad.unit_counts["ffn"], "vocab": 2 * h * 64 // ad.unit_counts["vocab"]}  # embedding + output rows
    sharded = [s for s in ad.specs if s.sharded]
    for rep in layout.replicas:
        group_rank = {m.member: m.tp_rank for m in rep.members}
        routes = [bucket_routes(sharded, layout, m, group_rank, True, torch.device("cpu")) for m in rep.members]
        part = {f: layout.partition_of(f) for f in numel}
        expected = sum(numel[f] for m in rep.members for f in numel for u in m.units[f] if part[f][u] != m.tp_rank)
        assert sum(sum(r.send_splits) for r in routes) == expected > 0
        for dst in range(rep.degree):  # what each reducer receives is what was sent to it
            assert sum(r.send_splits[dst] for r in routes) == sum(routes[dst].recv_splits)
        copies = sum(len(m.units["kv"]) for m in rep.members)
        assert copies > 2  # KV heads are replicated in both replicas
