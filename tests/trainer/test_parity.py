"""What the NTP runtime must show: loss parity (1e-5 relative, fp32) with a single-process
reference on the same global batch, across degrees, live transitions, unequal batches and
peer recovery. Real gloo processes on loopback."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from tpflex_trainer.ntp.config import GPTConfig, param_specs
from tpflex_trainer.ntp.layout import Member, ReplicaPlacement
from tpflex_trainer.ntp.reference import reference_losses, reference_run
from tpflex_trainer.ntp.runtime import GRAD_SCALE_ENV

from tests.support.ports import free_port, free_ports
from tests.trainer.harness import run_workers
from tests.trainer.scenarios import LR, SEED, Change, Scenario, global_batch, run_scenario

pytestmark = pytest.mark.slow

CFG = GPTConfig(n_layers=2, hidden=32, n_heads=8, n_kv_groups=4, ffn_hidden=64, ffn_block=8, vocab=64, vocab_block=8, seq_len=16)
REL_TOL = 1e-5  # losses and gradient norms
# final state, relative L2 over the whole model (every copy of every unit)
STATE_TOL = {"param": 1e-5, "exp_avg": 1e-5, "exp_avg_sq": 1e-5}


def rp(replica: int, slots, batch: int = 2) -> ReplicaPlacement:
    return ReplicaPlacement(replica, tuple(slots), batch)


def members_of(*placements: ReplicaPlacement) -> tuple[Member, ...]:
    return tuple(Member(p.replica, s) for p in placements for s in p.slots)


def reference(steps: int, batch_at) -> list[float]:
    return reference_losses(CFG, SEED, [global_batch(CFG, s, batch_at(s)) for s in range(steps)], lr=LR)


@dataclass(frozen=True)
class Reference:
    """The dense single-process run: per-step loss and gradient norm, final state."""

    losses: list[float]
    grad_norms: list[float]
    state: dict[str, dict[str, torch.Tensor]]  # kind -> parameter -> full tensor


def reference_full(steps: int, batch_at) -> Reference:
    return Reference(*reference_run(CFG, SEED, [global_batch(CFG, s, batch_at(s)) for s in range(steps)], lr=LR))


def unit_bytes(cfg: GPTConfig) -> dict[str, int]:
    """Bytes of one unit on the wire (its weights and both Adam moments, fp32) per family,
    from the config's shapes alone; "replicated": every unsharded parameter together."""
    d, hd, hpg, layers = cfg.hidden, cfg.hidden // cfg.n_heads, cfg.n_heads // cfg.n_kv_groups, cfg.n_layers
    numel = {
        "kv_groups": layers * d * ((hpg + 2) * hd + hpg * hd),  # q, k, v rows + the proj columns
        "ffn": layers * d * 2 * cfg.ffn_block,  # fc rows + proj columns
        "vocab": d * 2 * cfg.vocab_block,  # embedding rows + output rows
        "replicated": d * (cfg.seq_len + 4 * layers + 2),  # positions, 2 LayerNorms a layer, final LN
    }
    return {f: 3 * 4 * n for f, n in numel.items()}


def member_bytes(cfg: GPTConfig, degree: int) -> int:
    """The sharded units of one member of a replica at ``degree`` (which divides every
    family's unit count, so every member holds the same share)."""
    counts = {"kv_groups": cfg.n_kv_groups, "ffn": cfg.ffn_hidden // cfg.ffn_block, "vocab": cfg.vocab // cfg.vocab_block}
    assert all(n % degree == 0 for n in counts.values()), counts
    unit = unit_bytes(cfg)
    return sum(unit[f] * n // degree for f, n in counts.items())


def grad_bytes_bound(cfg: GPTConfig, degree: int, t_min: int) -> int:
    """Fewest gradient bytes a replica at ``degree`` moves in its TP group per step when the
    job's smallest degree is ``t_min``, from the shapes: core rank p reduces partition p
    (balanced sizes of the family's units over t_min) and can hold at most
    min(partition, its balanced share) of it; every other unit's gradient goes to its core
    and back, and the replicated gradients (plus the loss) go to each extra rank once."""
    counts = {"kv_groups": cfg.n_kv_groups, "ffn": cfg.ffn_hidden // cfg.ffn_block, "vocab": cfg.vocab // cfg.vocab_block}
    unit = unit_bytes(cfg)
    total = 0
    for fam, n in counts.items():
        sizes = sorted((n // degree + (i < n % degree) for i in range(degree)), reverse=True)
        parts = sorted((n // t_min + (i < n % t_min) for i in range(t_min)), reverse=True)
        off_core = n - sum(min(parts[p], sizes[p]) for p in range(t_min))
        total += 2 * off_core * unit[fam] // 3  # a gradient is one of the payload's 3 tensors
    return total + (degree - t_min) * (unit["replicated"] // 3 + 4)


def wire_bytes(results: dict, report: int, replica: int | None = None) -> int:
    """Bytes the members (of ``replica``, or all) put on the wire in a reshard: measured
    at the send (``ReshardReport.bytes_sent``)."""
    return sum(r["reports"][report]["bytes_sent"] for r in results.values()
               if replica is None or r["member"][0] == replica)


def _per_step(results: dict, key: str) -> dict[int, set[float]]:
    out: dict[int, set[float]] = {}
    for res in results.values():
        for step, value in res[key].items():
            out.setdefault(step, set()).add(value)
    return out


def state_rel_l2(results: dict, ref: Reference, kind: str) -> float:
    """||job - reference|| / ||reference|| over every copy of every unit the active
    members hold at the end (weights or one Adam moment), in float64."""
    rows = {s.name: s.unit_rows for s in param_specs(CFG)}
    diff = norm = 0.0
    for res in results.values():
        for (k, name, unit), got in res["states"].items():
            if k == kind:
                want = ref.state[kind][name][unit * rows[name] : (unit + 1) * rows[name]].double()
                diff += float((torch.from_numpy(got).double() - want).pow(2).sum())
                norm += float(want.pow(2).sum())
    return math.sqrt(diff / norm)


def parity_failures(results: dict, ref: Reference, steps: int, first: int = 0) -> list[str]:
    """Everything that breaks parity with the reference (empty when the run matches):
    every step's loss and global gradient norm (the same float on every active member),
    and the final weights and both Adam moments of every unit the job holds at the end."""
    bad = []
    for key, want in (("losses", ref.losses), ("grad_norms", ref.grad_norms)):
        by_step = _per_step(results, key)
        if sorted(by_step) != list(range(first, steps)):
            bad.append(f"{key}: steps {sorted(by_step)}, expected {first}..{steps - 1}")
            continue
        for step in range(first, steps):
            values = by_step[step]
            if len(values) != 1:
                bad.append(f"{key}[{step}]: active members disagree: {values}")
            elif abs(next(iter(values)) - want[step]) > REL_TOL * abs(want[step]):
                bad.append(f"{key}[{step}]: {next(iter(values))} vs reference {want[step]}")
    held = {(name, unit) for res in results.values() for (k, name, unit) in res["states"] if k == "param"}
    every = {(s.name, u) for s in param_specs(CFG) for u in range(s.n_units)}
    if held != every:
        bad.append(f"final state: units missing {sorted(every - held)[:5]}, unknown {sorted(held - every)[:5]}")
        return bad
    for kind, tol in STATE_TOL.items():
        rel = state_rel_l2(results, ref, kind)
        if rel > tol:
            bad.append(f"final {kind}: relative L2 {rel:.3g} > {tol:g}")
    return bad


def assert_parity(results: dict, ref: Reference, steps: int, first: int = 0) -> None:
    failures = parity_failures(results, ref, steps, first)
    assert not failures, "parity failures:\n" + "\n".join(failures)
    assert ref.losses[-1] < ref.losses[0]  # it trains


def test_tp4_and_tp3_from_the_start():
    start = (rp(0, range(4)), rp(1, range(3)))
    sc = Scenario(CFG, 4, start, steps=20, members=members_of(*start))
    results = run_workers(run_scenario, len(sc.members), (sc,))
    assert_parity(results, reference_full(20, lambda s: 4), 20)
    # gradient sync overlaps backward: the replica at t_min (no moves) starts every
    # bucket's all-reduce from the autograd hooks, and there are several buckets
    for res in results.values():
        if res["member"][0] == 1:
            reduced_early, buckets = res["overlap"]
            assert buckets > 1 and reduced_early == buckets
    # the gradient bytes the TP-4 replica's members sent in the last step's pre- and
    # post-sync moves (counted at the send) are the fewest the shapes allow; the TP-3
    # replica (t_min) moves none
    sent = {rep: sum(r["grad_bytes"] for r in results.values() if r["member"][0] == rep) for rep in (0, 1)}
    assert sent == {0: grad_bytes_bound(CFG, 4, 3), 1: 0}


def test_live_transition_4_4_to_4_3_and_back():
    start = (rp(0, range(4)), rp(1, range(4)))
    drained = (rp(0, range(4)), rp(1, (0, 1, 2)))
    sc = Scenario(
        CFG, 4, start, steps=20, members=members_of(*start),
        changes=(Change(8, drained), Change(14, start)),
    )
    results = run_workers(run_scenario, len(sc.members), (sc,))
    assert_parity(results, reference_full(20, lambda s: 4), 20)
    drained_member = next(r for r in results.values() if r["member"] == (1, 3, 0))  # (replica, slot, stage)
    assert set(drained_member["losses"]) == set(range(8)) | set(range(14, 20))
    to_43, back = results[0]["reports"][1:]
    assert to_43["source"] == back["source"] == "live"
    # bytes on the wire against what the change makes move, from the config's shapes: the
    # drained member's units (nothing else moves), then the returning member's units and the
    # replicated parameters (it held nothing); the reports' plan-side figures agree
    share = member_bytes(CFG, 4)
    assert wire_bytes(results, 1) == share == to_43["bytes_moved"]
    assert wire_bytes(results, 2) == share + unit_bytes(CFG)["replicated"] == back["bytes_moved"]


def test_three_degrees_in_one_job():
    start = (rp(0, range(4)), rp(1, range(3)), rp(2, (1, 3)))
    sc = Scenario(CFG, 4, start, steps=8, members=members_of(*start))
    results = run_workers(run_scenario, len(sc.members), (sc,))
    assert_parity(results, reference_full(8, lambda s: 6), 8)


def test_unequal_local_batches_plain_ntp():
    start = (rp(0, range(4), batch=4), rp(1, range(3), batch=3))
    sc = Scenario(CFG, 4, start, steps=8, members=members_of(*start))
    results = run_workers(run_scenario, len(sc.members), (sc,))
    assert_parity(results, reference_full(8, lambda s: 7), 8)


def test_peer_recovery_of_a_dead_rank():
    start = (rp(0, range(4)), rp(1, range(4)))
    degraded = (rp(0, range(4)), rp(1, (0, 1, 3)))
    dead = Member(1, 2)
    sc = Scenario(
        CFG, 4, start, steps=10, members=members_of(*start),
        changes=(Change(6, degraded, kill=dead, rejoin_port=free_port()),),
    )
    results = run_workers(run_scenario, len(sc.members), (sc,), expect_exits=1)
    assert len(results) == 7 and all(r["member"] != tuple(dead) for r in results.values())
    assert_parity(results, reference_full(10, lambda s: 4), 10)
    recovery = results[0]["reports"][1]
    assert recovery["source"] == "live" and recovery["step"] == 6
    assert recovery["peer_units"] > 0
    # exactly the dead member's units, all from the other replica (measured at the send)
    assert wire_bytes(results, 1) == wire_bytes(results, 1, replica=0) == member_bytes(CFG, 4)


def test_peer_recovery_after_a_rank_dies_mid_step():
    """The step fails on every survivor (no hang until the collective timeout: leaving
    peers tear their groups down), they re-initialise in-process and recover."""
    start = (rp(0, range(4)), rp(1, range(4)))
    degraded = (rp(0, (0, 2, 3)), rp(1, range(4)))
    dead = Member(0, 1)
    sc = Scenario(
        CFG, 4, start, steps=8, members=members_of(*start),
        changes=(Change(5, degraded, kill=dead, rejoin_port=free_port(), mid_step=True),),
    )
    results = run_workers(run_scenario, len(sc.members), (sc,), expect_exits=1, timeout_s=25)
    assert all(r["reports"][1]["step_failed"] != "completed" for r in results.values())
    assert_parity(results, reference_full(8, lambda s: 4), 8)
    assert results[0]["reports"][2]["peer_units"] > 0
    assert wire_bytes(results, 2) == wire_bytes(results, 2, replica=1) == member_bytes(CFG, 4)


def test_a_member_without_state_gets_its_units_from_peers():
    """A fresh process in a dead member's place (here: the member drops its runtime and
    state) rejoins the same layout; its units come from the other replica."""
    start = (rp(0, range(4)), rp(1, range(4)))
    sc = Scenario(CFG, 4, start, steps=8, members=members_of(*start),
                  changes=(Change(5, start, restart=Member(1, 2)),))
    results = run_workers(run_scenario, len(sc.members), (sc,))
    assert_parity(results, reference_full(8, lambda s: 4), 8)
    rejoin = results[0]["reports"][1]
    # its sharded units exist only on the other replica; the replicated ones in its own
    assert rejoin["source"] == "live" and rejoin["peer_units"] == rejoin["units_moved"] - 1 > 0
    # on the wire: its sharded units from replica 0, the replicated parameters from its own
    assert wire_bytes(results, 1, replica=0) == member_bytes(CFG, 4)
    assert wire_bytes(results, 1, replica=1) == unit_bytes(CFG)["replicated"]


def test_torn_step_resumes_from_the_newest_holders():
    start = (rp(0, range(4)), rp(1, range(3)))
    sc = Scenario(CFG, 4, start, steps=8, members=members_of(*start),
                  changes=(Change(6, start, stale=Member(1, 0)),))
    results = run_workers(run_scenario, len(sc.members), (sc,))
    assert_parity(results, reference_full(8, lambda s: 4), 8)
    torn = results[0]["reports"][1]
    assert torn["step"] == 6 and torn["peer_units"] > 0


def _drain_shrink_and_return(rank: int, world_size: int, port_shrink: int, port_grow: int) -> dict:
    """The trainer hooks' flow for TP 4+4 -> 4+3 -> 4+4: the leaving member hands over its
    units, the others continue in a smaller default group (groups rebound by train_step),
    and the returning member (stale state) rejoins through a new default group."""
    import torch.distributed as dist
    from tpflex_trainer.ntp.optim import AdamSettings
    from tpflex_trainer.ntp.runtime import NtpRuntime

    from tests.trainer.harness import init_gloo
    from tests.trainer.scenarios import local_batch, unit_states

    full, drained = (rp(0, range(4)), rp(1, range(4))), (rp(0, range(4)), rp(1, range(3)))
    everyone = list(members_of(*full))
    me = everyone[rank]
    leaving = Member(1, 3)
    rt = NtpRuntime(CFG, 4, me, adam=AdamSettings(lr=LR), seed=SEED)
    rt.start(full, {m: i for i, m in enumerate(everyone)})
    losses, norms = {}, {}
    for step in range(10):
        if step == 4:
            rt.apply_plan(drained, {m: i for i, m in enumerate(everyone)})
            dist.destroy_process_group()
            if me != leaving:
                init_gloo(everyone.index(me) - (everyone.index(me) > everyone.index(leaving)), 7, port_shrink)
        if step == 8:
            if me != leaving:
                dist.destroy_process_group()
            init_gloo(rank, 8, port_grow)
            report = rt.apply_plan(full, {m: i for i, m in enumerate(everyone)})
        if rt.active and dist.is_initialized():
            losses[step] = rt.train_step(*local_batch(rt, step))
            norms[step] = rt.last_grad_norm
    return {"member": tuple(me), "losses": losses, "grad_norms": norms, "states": unit_states(rt) if rt.active else {},
            "back": report.source, "moved": report.units_moved}


def test_drain_to_a_smaller_default_group_and_back():
    results = run_workers(_drain_shrink_and_return, 8, tuple(free_ports(2)), timeout_s=60)
    assert_parity(results, reference_full(10, lambda s: 4), 10)
    assert set(results[7]["losses"]) == set(range(4)) | set(range(8, 10))
    assert results[0]["back"] == "live" and results[0]["moved"] > 0


def test_a_run_with_sharded_gradients_times_3_fails_parity():
    """Adam hides a uniform gradient scale in the losses (they stay within tolerance); the
    gradient norms and the Adam moments do not. TP 2+1: the extra member's gradients take
    the pre- and post-sync moves."""
    start = (rp(0, range(2)), rp(1, (0,)))
    sc = Scenario(CFG, 2, start, steps=4, members=members_of(*start), env=((GRAD_SCALE_ENV, "3"),))
    results = run_workers(run_scenario, len(sc.members), (sc,))
    failures = parity_failures(results, reference_full(4, lambda s: 4), 4)
    assert not [f for f in failures if f.startswith("losses")], failures  # blind to it
    for what in ("grad_norms[0]", "grad_norms[3]", "final exp_avg:", "final exp_avg_sq:"):
        assert any(f.startswith(what) for f in failures), (what, failures)
