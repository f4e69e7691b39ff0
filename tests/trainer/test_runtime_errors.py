"""Bad requests to the runtime raise typed errors on every rank before any collective
(no rank is left waiting), and the job keeps its layout and trains on."""

from __future__ import annotations

import dataclasses
import math

import pytest
from tpflex_trainer.ntp.errors import CheckpointError, LayoutError, PlanError
from tpflex_trainer.ntp.layout import Member
from tpflex_trainer.ntp.optim import AdamSettings
from tpflex_trainer.ntp.runtime import NtpRuntime

from tests.support.ports import free_ports
from tests.trainer.harness import run_workers
from tests.trainer.scenarios import LR, SEED, global_batch, local_batch
from tests.trainer.test_parity import CFG, reference, rp

pytestmark = pytest.mark.slow


def _bad_requests(rank: int, world_size: int) -> dict:
    members = [Member(0, 0), Member(0, 1)]
    world = {m: i for i, m in enumerate(members)}
    rt = NtpRuntime(CFG, 2, members[rank], adam=AdamSettings(lr=LR), seed=SEED)
    rt.start((rp(0, (0, 1)),), world)
    layout = rt.layout
    codes = []
    bad_calls = [
        lambda: rt.apply_plan((rp(0, (0, 1, 2)),), world),  # degree above the domain
        lambda: rt.apply_plan((rp(0, ()),), world),  # degree 0
        lambda: rt.apply_plan((rp(0, (0, 1)),), {Member(0, 0): 0, Member(0, 5): 1}),  # world map
        lambda: rt.apply_plan((rp(0, (0, 1)),), world, checkpoint="/nonexistent/ckpt"),
        lambda: rt.train_step(*global_batch(CFG, 0, 3)),  # wrong local batch size
    ]
    for call in bad_calls:
        try:
            call()
            codes.append("accepted")
        except (LayoutError, PlanError, CheckpointError) as exc:
            codes.append(exc.code)
    assert rt.layout is layout
    loss = rt.train_step(*local_batch(rt, 0))
    return {"codes": codes, "loss": loss}


def test_bad_requests_are_refused_on_every_rank_without_a_hang():
    results = run_workers(_bad_requests, 2, timeout_s=60)
    expected = ["degree_above_domain", "degree_zero", "invalid_plan", "checkpoint_invalid", "invalid_plan"]
    for res in results.values():
        assert res["codes"] == expected
        assert math.isfinite(res["loss"])
    assert results[0]["loss"] == results[1]["loss"]


def _mismatched_members(rank: int, world_size: int) -> str:
    members = [Member(0, 0), Member(0, 1)]
    cfg = CFG if rank == 0 else dataclasses.replace(CFG, n_layers=1)
    rt = NtpRuntime(cfg, 2, members[rank], seed=SEED)
    try:
        rt.start((rp(0, (0, 1)),), {m: i for i, m in enumerate(members)})
    except PlanError as exc:
        return exc.code
    return "accepted"


def test_members_with_another_model_config_are_refused_on_every_rank():
    assert run_workers(_mismatched_members, 2, timeout_s=60) == {0: "invalid_plan", 1: "invalid_plan"}


def _reinit_then_rebind(rank: int, world_size: int, port: int, port2: int) -> dict:
    import torch.distributed as dist

    from tests.trainer.harness import init_gloo

    members = [Member(0, 0), Member(0, 1), Member(1, 0), Member(1, 1)]
    rt = NtpRuntime(CFG, 2, members[rank], adam=AdamSettings(lr=LR), seed=SEED)
    rt.start((rp(0, (0, 1)), rp(1, (0, 1))), {m: i for i, m in enumerate(members)})
    rt.train_step(*local_batch(rt, 0))
    order = list(reversed(members))  # the new default group numbers the ranks differently
    dist.destroy_process_group()
    init_gloo(order.index(members[rank]), world_size, port)
    loss_auto = rt.train_step(*local_batch(rt, 1))  # every member steps: they rebind together
    dist.destroy_process_group()
    init_gloo(rank, world_size, port2)
    report = rt.rebind()  # explicit
    return {"moved": report.units_moved, "loss_auto": loss_auto, "loss": rt.train_step(*local_batch(rt, 2))}


def test_groups_are_rebuilt_for_a_reinitialised_default_group():
    results = run_workers(_reinit_then_rebind, 4, tuple(free_ports(2)), timeout_s=60)
    assert {r["moved"] for r in results.values()} == {0}
    assert len({r["loss_auto"] for r in results.values()}) == 1
    assert len({r["loss"] for r in results.values()}) == 1
    ref = reference(3, lambda s: 4)
    for r in results.values():
        assert abs(r["loss_auto"] - ref[1]) <= 1e-5 * ref[1] and abs(r["loss"] - ref[2]) <= 1e-5 * ref[2]
