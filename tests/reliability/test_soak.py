"""The short chaos soak (bench/soak.py --faults 5): 8 ranks on two tpflex-run nodes, a
3-member etcd and two controllers, one fault of each kind but one in a random order (rank
SIGKILL, rank frozen, XID 79, leader controller killed, etcd member killed; an agent frozen
within its lease, which the job does not notice, runs in the 10-minute soak: the XID's
replay and oracle took its time); the job
must lose no completed step, need no checkpoint (it checkpoints every 20 steps, so a
restart from one could happen), end bit for bit with the weights of the same job run
without faults in the chaos run's layouts (bench/soak.py's same-layout reference), and
every layout change (the XID's degraded layout, its repair) must match the independent
single-process reference from the state it started from (bench/soak_oracle.py). Paced steps keep the fault-free
replay short; the fixed-layout baseline is that arithmetic replayed in 8 forkserver gloo
processes (``--baseline replay``, no second cluster: bench/soak.py's 2-minute and
10-minute runs train it through a fresh control plane). The ranks are forked from
tpflex-run's zygote (``--preload``: no rank, first or restarted, imports torch itself;
the faults and the recoveries asserted are the same). A fixed seed fixes the fault
schedule, not the timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"
KEYS = {"faults_injected", "faults_by_kind", "lost_steps", "weights_rel_l2", "weights_rel_l2_vs_fixed_layout",
        "max_pause_s", "p50_pause_s", "checkpoint_restarts", "torn_steps_replayed", "layout_changes_checked",
        "oracle_max_rel_l2"}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_minute_soak_loses_nothing():
    kinds = "rank_sigkill,rank_hang,xid79,controller_leader_kill,etcd_member_kill"
    # a fixed fault schedule (which kinds in which order, which ranks); the timing is the
    # machine's: on a loaded one the recovery paths run slower, which they must survive
    proc = subprocess.run([sys.executable, str(SOAK), "--faults", "5", "--step-min-s", "0.4", "--kinds", kinds,
                           "--seed", "13", "--baseline", "replay", "--preload", "--checkpoint-every", "20"],
                          capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    got = json.loads(lines[0])
    print(got, proc.stderr[-1500:])
    assert set(got) == KEYS
    assert got["faults_injected"] == 5 and got["faults_by_kind"] == dict.fromkeys(sorted(kinds.split(",")), 1), got
    assert got["lost_steps"] == 0 and got["checkpoint_restarts"] == 0
    # vs the same-layout reference: the replay of the chaos run's rounds (the XID 79 changed
    # the layout and the data; the fixed-layout baseline only shows how far that went)
    assert got["weights_rel_l2"] is not None and got["weights_rel_l2"] <= 1e-5
    assert isinstance(got["weights_rel_l2_vs_fixed_layout"], float)
    # the XID's degraded layout and its repair, each against the single-process reference
    # (a miss exits 1 above; the bound is checked here too)
    assert got["layout_changes_checked"] >= 2 and got["oracle_max_rel_l2"] <= 1e-5, got
    # no pause reached the collective timeout (60 s here): survivors never waited one out
    assert 0 < got["p50_pause_s"] <= got["max_pause_s"] < 60, got


BAD_ARGS = [(["--minutes", "0"], "--minutes"), (["--kinds", "meteor"], "--kinds"), (["--faults", "-1"], "--faults"),
            (["--step-min-s", "nan"], "--step-min-s"), (["--baseline", "moon"], "--baseline"),
            (["--checkpoint-every", "0"], "--checkpoint-every")]


def test_soak_refuses_bad_arguments_as_a_process():
    proc = subprocess.run([sys.executable, str(SOAK), "--kinds", "meteor"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "--kinds" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, name", BAD_ARGS)
def test_soak_refuses_bad_arguments(args, name, capsys):
    # the arguments are checked in main() before anything starts: in this process, without
    # a start-up (torch, the demo) per case; the real process's exit status is checked above
    from bench.soak import main

    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2 and name in capsys.readouterr().err


def _step(rank: int, step: int, t: float) -> dict:
    return {"kind": "step", "rank": rank, "step": step, "t": t, "generation": 3, "degrees": [2, 2]}


def _round(step: int, t: float, source: str = "live") -> dict:
    return {"kind": "applied", "generation": 4, "epoch": 1, "source": source, "step": step, "t": t}


def test_a_replayed_torn_step_is_not_a_lost_step():
    from bench.soak import lost_steps

    before = [_step(r, s, s + r / 10) for s in range(5) for r in range(4)]
    torn = [_step(0, 5, 5.0), _step(1, 5, 5.1)]  # ranks 2 and 3 never applied step 5
    assert lost_steps([*before, *torn, _round(5, 9.0)]) == (0, 0, 1)
    whole = [_step(r, 5, 5 + r / 10) for r in range(4)]  # every rank applied step 5: done
    assert lost_steps([*before, *whole, _round(5, 9.0)]) == (1, 0, 0)
    assert lost_steps([*before, *torn, _step(0, 6, 6.0), _round(5, 9.0, "checkpoint")]) == (1, 1, 1)
    assert lost_steps([*before, *torn, _round(6, 9.0)]) == (0, 0, 0)  # resumed from the newest copies


def test_a_restart_from_scratch_loses_every_completed_step():
    # a second init round (nobody held state, no checkpoint: the job starts again from its
    # seed) redoes every step the job had completed, as a live round that goes back does
    from bench.soak import lost_steps

    first = {**_round(0, 0.5, "init"), "generation": 1, "epoch": 0}
    done = [_step(r, s, 1 + s + r / 10) for s in range(50) for r in range(4)]
    assert lost_steps([first, *done]) == (0, 0, 0)
    assert lost_steps([first, *done, _round(0, 60.0, "init")]) == (50, 0, 0)
    assert lost_steps([first, *done, _round(20, 60.0)]) == (30, 0, 0)
    assert lost_steps([first, *done, _round(50, 60.0)]) == (0, 0, 0)


def _plan(generation: int, gpus: list[int]):
    from tpflex_proto import types_pb2

    plan = types_pb2.Plan(job="soak", generation=generation)
    plan.replicas.add(index=0, tp_degree=len(gpus)).stages.add(gpus=[types_pb2.GpuRef(node="n", index=i) for i in gpus])
    return plan


def _applied(rank: int, pid: int, generation: int, epoch: int, step: int, at: float, source: str = "live") -> dict:
    return {"kind": "applied", "rank": rank, "pid": pid, "generation": generation, "epoch": epoch, "step": step,
            "at": at, "t": at + 5, "source": source}


def test_the_replay_follows_the_chaos_runs_rounds_with_their_restarted_ranks():
    from bench.soak_replay import ReplayUnsupported, one_layout, rounds_from

    plans = {1: _plan(1, [0, 1, 2, 3]), 2: _plan(2, [0, 1, 2]), 3: _plan(3, [0, 1, 2, 3])}
    records = [_applied(r, 100 + r, 1, 0, 0, 1.0, "init") for r in range(4)]
    records += [_applied(r, 100 + r if r != 2 else 202, 1, 1, 5, 2.0) for r in range(4)]  # rank 2 restarted
    records += [_applied(r, 100 + r if r != 2 else 202, 2, 1, 8, 3.0) for r in range(3)]  # XID: rank 3 out
    records += [_applied(3, 303, 2, 1, 8, 3.1, "idle")]
    records += [_applied(r, {2: 202, 3: 303}.get(r, 100 + r), 3, 2, 10, 4.0) for r in range(4)]
    rounds = rounds_from(records, plans, 12)
    assert [(r.step, r.end, r.generation, r.fresh) for r in rounds] == [
        (0, 5, 1, (0, 1, 2, 3)), (5, 8, 1, (2,)), (8, 10, 2, ()), (10, 12, 3, (3,))]
    assert not one_layout(rounds) and one_layout(rounds[:2])
    with pytest.raises(ReplayUnsupported, match="generation 3"):
        rounds_from(records, {1: plans[1], 2: plans[2]}, 12)
    with pytest.raises(ReplayUnsupported, match="checkpoint"):
        rounds_from([*records, _applied(0, 100, 3, 3, 0, 5.0, "checkpoint")], plans, 12)
    with pytest.raises(ReplayUnsupported, match="went back"):
        rounds_from(records, plans, 9)


def test_the_replay_refuses_a_round_that_went_back_to_step_0():
    # replaying such a run repeats the restart and matches it (0.0): the replay must not vouch
    from bench.soak_replay import ReplayUnsupported, rounds_from

    plans = {1: _plan(1, [0, 1, 2, 3])}
    first = [_applied(r, 100 + r, 1, 0, 0, 1.0, "init") for r in range(4)]
    steps = [{"kind": "step", "rank": r, "pid": 100 + r, "step": s, "t": 7.0 + s / 100 + r / 1000}
             for s in range(50) for r in range(4)]
    assert [(r.step, r.end) for r in rounds_from([*first, *steps], plans, 50)] == [(0, 50)]
    again = [_applied(r, 200 + r, 1, 1, 0, 9.0, "init") for r in range(4)]
    with pytest.raises(ReplayUnsupported, match="at step 0, below step 49"):
        rounds_from([*first, *steps, *again], plans, 50)
    back = [_applied(r, 100 + r, 1, 1, 30, 9.0) for r in range(4)]  # a live round going back too
    with pytest.raises(ReplayUnsupported, match="at step 30, below step 49"):
        rounds_from([*first, *steps, *back], plans, 50)


def test_the_replay_starts_a_member_left_behind_by_a_torn_step_without_state():
    # the chaos run: rank 1 died inside step 5, whose last collective failed on rank 2 while
    # ranks 0 and 3 applied the update. When the job goes on from step 6 (the newest copies
    # all survived), rank 2's state (at step 5) is not used: the runtime plans the layout
    # without it and re-sends it its units, as for a new process (tests/trainer/
    # test_torn_step.py shows the two are the same bit for bit, and a holder is not)
    from bench.soak_replay import rounds_from

    def step(rank: int, pid: int, s: int) -> dict:
        return {"kind": "step", "rank": rank, "pid": pid, "step": s, "t": 1.0 + s / 10 + rank / 100}

    plans = {1: _plan(1, [0, 1, 2, 3])}
    first = [_applied(r, 100 + r, 1, 0, 0, -4.5, "init") for r in range(4)]
    steps = [step(r, 100 + r, s) for s in range(5) for r in range(4)] + [step(r, 100 + r, 5) for r in (0, 3)]
    forward = [_applied(r, 201 if r == 1 else 100 + r, 1, 1, 6, 3.0) for r in range(4)]
    rounds = rounds_from([*first, *steps, *forward], plans, 9)
    assert [(r.step, r.end, r.fresh) for r in rounds] == [(0, 6, (0, 1, 2, 3)), (6, 9, (1, 2))]
    # the other way out of a torn step: ranks 0 and 3 undo their update, step 5 is run
    # again; every survivor holds its state at step 5
    rollback = [_applied(r, 201 if r == 1 else 100 + r, 1, 1, 5, 3.0) for r in range(4)]
    rounds = rounds_from([*first, *steps, *rollback], plans, 9)
    assert [(r.step, r.end, r.fresh) for r in rounds] == [(0, 5, (0, 1, 2, 3)), (5, 9, (1,))]


def test_state_digests_tell_rounds_that_started_from_other_bits():
    import torch
    from tpflex_trainer.ntp.state import LocalState, state_digest

    from bench.soak import round_divergences

    def state(step: int, bump: float = 0.0) -> LocalState:
        w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        w[1, 2] += bump
        return LocalState({"heads": (0, 1)}, {"param": {"w": w}, "exp_avg": {"w": torch.zeros(2, 3)}}, step)

    same, other = state_digest(state(4)), state_digest(state(4, 2.0 ** -20))  # one element changed
    assert same == state_digest(state(4)) and same != other and same != state_digest(state(5))

    def entered(rank: int, step: int, digest: str, units=None) -> dict:
        return {"kind": "entered", "rank": rank, "generation": 2, "epoch": 1, "step": step, "digest": digest,
                "units": units or {"heads": [0, 1]}}

    chaos = [entered(0, 10, same), entered(1, 10, other, {"heads": [2, 3]}), entered(1, 30, same)]
    replayed = [{**entered(0, 10, same), "kind": "replayed"}, {**entered(1, 10, same), "kind": "replayed"}]
    assert round_divergences(chaos, replayed) == [
        {"rank": 1, "generation": 2, "epoch": 1, "step": 10, "same_units": False,
         "units": {"heads": [2, 3]}, "replay_units": {"heads": [0, 1]}}]


def test_the_soaks_wait_is_the_shared_poll_with_the_soaks_own_failure():
    from bench.soak_chaos import wait
    from tests.support.wait import wait_until

    seen = iter([None, 0, "ready"])
    assert wait(lambda: next(seen), 5, "a value", interval=0.001) == "ready"
    with pytest.raises(TimeoutError, match=r"^soak: the thing not within 0s$"):
        wait(lambda: None, 0.05, "the thing", interval=0.001)
    with pytest.raises(AssertionError, match=r"^timed out after 0.05s waiting for the thing$"):
        wait_until(lambda: None, 0.05, "the thing", interval=0.001)


def test_every_layout_change_needs_a_window_the_oracle_checked():
    from bench.soak_oracle import Check, layout_changes, summary

    def step(generation: int, degrees: list[int], batch: int, t: float) -> dict:
        return {"kind": "step", "generation": generation, "degrees": degrees, "global_batch": batch, "t": t}

    # generation 2 re-planned the same layout (no change); 3 is an XID's degraded layout
    # (TP 4+3 on 7 samples), 4 its repair
    records = [step(1, [4, 4], 8, 1.0), step(2, [4, 4], 8, 2.0), step(3, [4, 3], 7, 3.0), step(4, [4, 4], 8, 4.0),
               step(3, [4, 3], 7, 3.5)]
    assert layout_changes(records) == [3, 4]
    checks = [Check(1, 0, 0, True, 7e-6), Check(3, 0, 10, True, 2e-7), Check(4, 0, 20, False, why="a rank died"),
              Check(4, 1, 25, True, 1e-7)]
    assert summary(checks, [3, 4]) == (2, 7e-6, [])
    checked, worst, misses = summary([Check(3, 0, 10, True, 3e-3), Check(4, 0, 20, False, why="a rank died")], [3, 4])
    assert (checked, worst, len(misses)) == (1, 3e-3, 2)
    assert "3e-03" in misses[0] or "0.003" in misses[0]
    assert "generation 4 not checked" in misses[1] and "a rank died" in misses[1]


def test_the_oracles_reference_continues_the_single_process_run_exactly():
    # the oracle starts the single-process reference from a dumped state at its Adam step:
    # 2 steps, a stop, 2 more must be the 4-step run bit for bit
    import torch
    from tpflex_trainer.demo.data import global_batch
    from tpflex_trainer.demo.model import DEMO_ADAM, DEMO_MODEL, DEMO_SEED
    from tpflex_trainer.ntp.reference import reference_state, state_rel_l2

    from bench.soak_oracle import reference_from

    batches = [global_batch(DEMO_MODEL, s, 7) for s in range(4)]
    kw = dict(lr=DEMO_ADAM.lr, betas=DEMO_ADAM.betas, eps=DEMO_ADAM.eps)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads only contend on the shared cores
    try:
        losses, whole = reference_state(DEMO_MODEL, DEMO_SEED, batches, **kw)
        first, mid = reference_state(DEMO_MODEL, DEMO_SEED, batches[:2], **kw)
        rest, end = reference_from(DEMO_MODEL, mid, 2, batches[2:], **kw, dtype=torch.float32)
        # the Adam step matters (bias correction): a reference started at the wrong one misses
        _, off = reference_from(DEMO_MODEL, mid, 0, batches[2:], **kw, dtype=torch.float32)
        _, end64 = reference_from(DEMO_MODEL, mid, 2, batches[2:], **kw)  # what the oracle runs
    finally:
        torch.set_num_threads(threads)
    assert first + rest == losses
    assert all(state_rel_l2(end[k], whole[k]) == 0.0 for k in whole)
    assert state_rel_l2(off["param"], whole["param"]) > 1e-5
    # in float64 (returned as float32): the same run within rounding, not bit for bit
    assert all(end64[k][n].dtype == torch.float32 for k in end64 for n in end64[k])
    assert 0.0 < state_rel_l2(end64["param"], whole["param"]) < 1e-5
    assert torch.get_default_dtype() == torch.float32
