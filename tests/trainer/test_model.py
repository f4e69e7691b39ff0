"""Single-process pieces: the unit-sharded GPT against the dense reference, Adam against
torch.optim.Adam, per-unit payloads, checkpoint files, config and plan adapters."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tpflex_trainer.ntp.checkpoint import CheckpointReader, write_member_units, write_meta
from tpflex_trainer.ntp.config import REPLICATED, GPTConfig, param_specs
from tpflex_trainer.ntp.errors import CheckpointError, ConfigError, LayoutError, PlanError
from tpflex_trainer.ntp.layers import ColumnParallelLinear, ParallelMLP, RowParallelLinear
from tpflex_trainer.ntp.layout import ReplicaPlacement, plan_layout
from tpflex_trainer.ntp.model import ShardedGPT
from tpflex_trainer.ntp.optim import AdamSettings, adam_step
from tpflex_trainer.ntp.plan_adapter import placements_from_plan
from tpflex_trainer.ntp.reference import reference_loss, reference_params
from tpflex_trainer.ntp.state import build_state, init_local_state, member_units, unit_payload

from tests.trainer.scenarios import global_batch

CPU = torch.device("cpu")


def whole_units(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    return member_units({f: tuple(range(n)) for f, n in cfg.unit_counts().items()})


@pytest.mark.parametrize("heads,groups", [(8, 4), (4, 4), (8, 1)])  # GQA, MHA, MQA
def test_single_member_model_matches_reference(heads, groups):
    cfg = GPTConfig(n_heads=heads, n_kv_groups=groups)
    specs = param_specs(cfg)
    state = init_local_state(specs, whole_units(cfg), seed=3, device=CPU)
    model = ShardedGPT(cfg, state.units, state.tensors["param"], group=None)
    ref = reference_params(cfg, seed=3)
    tokens, targets = global_batch(cfg, 0, 3)
    loss = model.loss(tokens, targets)
    ref_loss = reference_loss(cfg, ref, tokens, targets)
    assert torch.allclose(loss, ref_loss, rtol=1e-6)
    loss.backward()
    ref_loss.backward()
    for spec, p in model.params_in_spec_order():
        assert torch.allclose(p.grad, ref[spec.name].grad, rtol=1e-4, atol=1e-7), spec.name


def test_adam_matches_torch_adam_bit_for_bit():
    cfg = GPTConfig()
    specs = param_specs(cfg)
    state = init_local_state(specs, whole_units(cfg), seed=1, device=CPU)
    ref = {n: t.clone().requires_grad_(True) for n, t in state.tensors["param"].items()}
    settings = AdamSettings(lr=0.01)
    opt = torch.optim.Adam(ref.values(), lr=0.01, foreach=False)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        grads = {n: torch.randn(t.shape, generator=gen) for n, t in ref.items()}
        for n, t in ref.items():
            t.grad = grads[n].clone()
        opt.step()
        adam_step(state, grads, settings)
    assert state.step == 3
    for n, t in ref.items():
        assert torch.equal(state.tensors["param"][n], t.detach()), n


def test_unit_payloads_rebuild_any_shard():
    cfg = GPTConfig()
    specs = param_specs(cfg)
    full = init_local_state(specs, whole_units(cfg), seed=2, device=CPU)
    full.tensors["exp_avg"]["head.weight"].normal_()
    shard_units = member_units({"kv_groups": (1, 3), "ffn": (0, 5, 6), "vocab": (7,)})
    shard = build_state(specs, shard_units, 4, CPU, lambda f, u: unit_payload(full, specs, f, u))
    rows = cfg.vocab_block
    assert torch.equal(shard.tensors["exp_avg"]["head.weight"], full.tensors["exp_avg"]["head.weight"][7 * rows : 8 * rows])
    fc = full.tensors["param"]["h1.mlp.fc.weight"]
    b = cfg.ffn_block
    expected = torch.cat([fc[0:b], fc[5 * b : 6 * b], fc[6 * b : 7 * b]])
    assert torch.equal(shard.tensors["param"]["h1.mlp.fc.weight"], expected)
    assert torch.equal(shard.tensors["param"]["pos.weight"], full.tensors["param"]["pos.weight"])


def test_checkpoint_files_round_trip_per_unit(tmp_path):
    cfg = GPTConfig()
    specs = param_specs(cfg)
    layout = plan_layout(cfg.unit_counts(), (ReplicaPlacement(0, (0, 1, 2)),), 4)
    full = init_local_state(specs, whole_units(cfg), seed=5, device=CPU)
    files = []
    for m in layout.members():
        state = build_state(specs, member_units(m.units), 9, CPU, lambda f, u: unit_payload(full, specs, f, u))
        files.append(write_member_units(tmp_path, m, state, specs))
    with pytest.raises(CheckpointError):
        CheckpointReader(tmp_path, cfg)  # no meta yet: incomplete
    write_meta(tmp_path, cfg, 9, files)
    reader = CheckpointReader(tmp_path, cfg)
    assert reader.step == 9
    for fam, n in [*cfg.unit_counts().items(), (REPLICATED, 1)]:
        for u in range(n):
            assert torch.equal(reader.payload(fam, u), unit_payload(full, specs, fam, u))


def test_partner_layers_with_different_units_are_refused():
    fc = ColumnParallelLinear(torch.nn.Parameter(torch.zeros(16, 4)), (0, 1), None)
    proj = RowParallelLinear(torch.nn.Parameter(torch.zeros(8, 4)), (0,), None)
    with pytest.raises(LayoutError) as err:
        ParallelMLP(fc, proj)
    assert err.value.code == "partner_unit_mismatch"


@pytest.mark.parametrize(
    "change", [{"hidden": 30}, {"n_kv_groups": 3}, {"ffn_block": 7}, {"vocab_block": 5}, {"n_layers": 0}]
)
def test_invalid_config_is_refused(change):
    with pytest.raises(ConfigError):
        dataclasses.replace(GPTConfig(), **change)


def test_placements_from_controller_plan():
    from tpflex_proto import types_pb2 as pb

    gpus = [pb.GpuRef(node=f"n{i // 2}", index=i % 2) for i in range(4)]
    spec = pb.JobSpec(base_tp=4, replicas=[pb.ReplicaSpec(stages=[pb.StageSpec(rack="r0", ranks=gpus)])] * 2)
    plan = pb.Plan(replicas=[
        pb.ReplicaPlan(index=0, tp_degree=3, local_batch=3,
                       stages=[pb.StagePlan(rack="r0", tp_degree=3, gpus=[gpus[0], gpus[3], gpus[1]])]),
        pb.ReplicaPlan(index=1, tp_degree=0, local_batch=0),  # dropped
    ])
    assert placements_from_plan(plan, spec) == (ReplicaPlacement(0, (0, 3, 1), 3),)
    bad = pb.Plan(replicas=[pb.ReplicaPlan(index=0, tp_degree=1, local_batch=1, stages=[
        pb.StagePlan(rack="r0", tp_degree=1, gpus=[pb.GpuRef(node="elsewhere", index=0)])])])
    with pytest.raises(PlanError):
        placements_from_plan(bad, spec)
