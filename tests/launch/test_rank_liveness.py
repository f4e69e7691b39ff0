"""Issue 13's kill test: two ``tpflex-run`` processes as two "nodes" (4 local ranks each)
against a real control plane (etcd, controller, simulated agents). One rank process is
SIGKILLed in the middle of training, its GPU healthy: tpflex-run reports the exit and
restarts only that rank, the controller raises the job's restart epoch (a soft failure,
the plan keeps the GPU), the survivors abort and re-form their groups in-process, the
restarted rank receives its units from peers, and the job finishes without a checkpoint
restart, with the single-process reference's losses, weights and Adam moments.

The job is also the check of the launchers' plain path (once a test of its own, a second
cluster): the ranks rendezvous through the controller's store (``tpflex://``, keys in etcd
bound to the job's lease; no TCPStore anywhere), node-0's launcher never restarts a rank,
and both launchers end with "all ranks done" and status 0."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from tpflex_proto import codec, keys, planstore, types_pb2
from tpflex_trainer.demo.cluster import DemoCluster, DemoPorts
from tpflex_trainer.demo.data import global_batch
from tpflex_trainer.demo.model import DEMO_ADAM, DEMO_MODEL, DEMO_SEED
from tpflex_trainer.ntp.adapter import as_adapter
from tpflex_trainer.ntp.checkpoint import read_full_state
from tpflex_trainer.ntp.reference import reference_state, state_rel_l2

from bench.soak_replay import Round, replay
from tests.e2e.support import free_base_port, rel_diff
from tests.launch.demo_job import (
    LOCAL_BATCH,
    RACKS,
    kill_launchers,
    read_records,
    start_job,
    wait_rank_step,
)
from tests.launch.support import base_env

STEPS, VICTIM = 10, 5  # rank 5: node-1, local rank 1


def _plan_gpus(plan: types_pb2.Plan) -> list[set[tuple[str, int]]]:
    """Per replica the GPUs it trains on."""
    return [{(g.node, g.index) for st in rep.stages for g in st.gpus} for rep in plan.replicas if rep.tp_degree]


def _run_job(tmp: Path) -> dict:
    """Run the 8-rank job on two launchers, SIGKILL the victim rank after its step 2.
    Returns what the test checks."""
    tmp.mkdir()
    cluster = DemoCluster(DemoPorts(free_base_port()), RACKS, tmp / "cluster")
    out, final = tmp / "steps.jsonl", tmp / "final"
    env = base_env(TPFLEX_DEMO_OUT=str(out), TPFLEX_DEMO_STEPS=str(STEPS), TPFLEX_DEMO_FINAL_DIR=str(final),
                   TPFLEX_DEMO_STEP_MIN_S="0.2", GLOO_SOCKET_IFNAME="lo", TPFLEX_LOG_LEVEL="INFO")
    launchers, liveness, drained, plan = [], None, -1, None
    try:
        cluster.start()
        spec, launchers = start_job(cluster, tmp, "liveness", env, ["--backoff-s", "0.5"])
        victim = wait_rank_step(out, VICTIM, 2)
        os.kill(victim["pid"], signal.SIGKILL)
        statuses = [p.wait(timeout=200) for p in launchers]
        kv = cluster.etcd.get(keys.liveness("liveness"))
        liveness = codec.decode(types_pb2.Liveness, kv.value) if kv is not None else None
        drained = cluster.etcd.count_prefix(keys.gpu_override("node-1", 1))
        plan = planstore.read_plan(cluster.etcd, "liveness")
        store_keys = cluster.etcd.count_prefix(keys.rendezvous_keys("liveness"))
        store_lease = cluster.etcd.get(keys.rendezvous_lease("liveness"))
    finally:
        kill_launchers(launchers)
        cluster.stop()
    full_logs = {r.node: (tmp / f"{r.node}.log").read_text() for r in RACKS}
    logs = {node: text[-3000:] for node, text in full_logs.items()}
    assert statuses == [0, 0], logs
    step, state = read_full_state(final, as_adapter(DEMO_MODEL, spec.base_tp))
    return dict(records=read_records(out), logs=logs, full_logs=full_logs, liveness=liveness, drained=drained,
                step=step, state=state, spec=spec, plan=plan, store_keys=store_keys, store_lease=store_lease)


def _run_uninterrupted(tmp: Path, spec: types_pb2.JobSpec, plan: types_pb2.Plan) -> dict:
    """The same job run uninterrupted in the same layout: 8 gloo processes drive the
    runtime through all the steps in one round of ``plan`` (bench/soak_replay.py, the
    soak's same-layout reference: each step on the global batch split by replica as the
    hooks do, so the same reduction order as the job's workers). Its final state."""
    rounds = [Round(step=0, end=STEPS, generation=plan.generation, plan=plan.SerializeToString(),
                    fresh=tuple(range(8)))]
    for attempt in (1, 2):
        final = tmp / f"uninterrupted-{attempt}"
        try:
            replay(spec, rounds, {}, final, timeout_s=180)
            break
        except AssertionError as exc:
            # the reference's own gloo rendezvous (8 local processes) failed to connect: seen
            # twice in loaded whole-suite runs, never reproduced alone. The reference is a
            # computation, not what this test checks: run it once more from scratch; any
            # other failure, or a second one, fails the test
            if attempt == 2 or "connectFullMesh failed" not in str(exc):
                raise
    step, state = read_full_state(final, as_adapter(DEMO_MODEL, spec.base_tp))
    assert step == STEPS
    return state


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_killed_rank_is_restarted_and_the_job_goes_on_without_a_checkpoint(tmp_path):
    run = _run_job(tmp_path / "killed")
    records, logs, liveness = run["records"], run["logs"], run["liveness"]
    # only the victim was restarted; every survivor ran as one process throughout
    pids = {}
    for r in records:
        pids.setdefault(r["rank"], set()).add(r["pid"])
    assert {rank: len(p) for rank, p in pids.items()} == {r: 2 if r == VICTIM else 1 for r in range(8)}
    assert "rank died; restarting it" in logs["node-1"] and "reason=signal:SIGKILL" in logs["node-1"]
    assert "rank died" not in logs["node-0"]
    # the rendezvous went through the controller: keys in etcd, bound to the job's lease;
    # both launchers ended with every rank done
    assert run["store_keys"] > 0 and run["store_lease"] is not None
    for node, text in run["full_logs"].items():
        assert "all ranks done" in text and "store=tpflex://" in text, (node, text[-3000:])
    # the controller recorded a soft failure: a new restart epoch, the GPU kept (not drained)
    assert liveness is not None and liveness.restart.epoch >= 1, logs
    assert [(f.rank, f.node, f.gpu, f.reason) for f in liveness.recent] == [(VICTIM, "node-1", 1, "signal:SIGKILL")]
    assert run["drained"] == 0
    # no checkpoint restart: the restarted rank got its units from peers, nobody went back to step 0
    applied = [r for r in records if r["kind"] == "applied"]
    rejoin = [r for r in applied if r["rank"] == VICTIM and r["incarnation"] == 1]
    assert rejoin and rejoin[0]["source"] == "live" and rejoin[0]["peer_units"] > 0 and rejoin[0]["step"] >= 2, rejoin
    assert all(r["source"] in ("init", "live") for r in applied)
    assert [r for r in applied if r["source"] == "init" and r["incarnation"] > 0] == []
    assert {r["epoch"] for r in applied if r["incarnation"] == 1} == {liveness.restart.epoch}
    # parity with the single-process reference: every step's loss (a step re-run after the
    # failure counts with its last loss), then weights and Adam moments
    losses = {r["step"]: r["loss"] for r in records if r["kind"] == "step" and r["rank"] == 0}
    assert sorted(losses) == list(range(STEPS))
    batches = [global_batch(DEMO_MODEL, s, LOCAL_BATCH * len(RACKS)) for s in range(STEPS)]
    ref_losses, ref_state = reference_state(DEMO_MODEL, DEMO_SEED, batches, lr=DEMO_ADAM.lr,
                                            betas=DEMO_ADAM.betas, eps=DEMO_ADAM.eps)
    assert max(rel_diff(losses[s], ref_losses[s]) for s in range(STEPS)) < 1e-5
    assert run["step"] == STEPS
    kinds = ("param", "exp_avg", "exp_avg_sq")
    killed_vs_ref = {k: state_rel_l2(run["state"][k], ref_state[k]) for k in kinds}
    # and with the same job run uninterrupted (same layout, same reduction order): the
    # recovery lost nothing, so the final states agree far below the layout's rounding.
    # The soft failure kept the layout: the plan the job ended with places all 8 GPUs
    plan = run["plan"]
    assert plan is not None and sorted(len(g) for g in _plan_gpus(plan)) == [4, 4], plan
    clean = _run_uninterrupted(tmp_path, run["spec"], plan)
    clean_vs_ref = {k: state_rel_l2(clean[k], ref_state[k]) for k in kinds}
    killed_vs_clean = {k: state_rel_l2(run["state"][k], clean[k]) for k in kinds}
    print(f"killed_vs_ref={killed_vs_ref} clean_vs_ref={clean_vs_ref} killed_vs_clean={killed_vs_clean}")
    # weights and both Adam moments against the reference (a wrong gradient scale leaves the
    # losses and, through Adam, nearly the weights in tolerance, not the moments); seen:
    # param 3.7e-06, exp_avg 1.0e-05, exp_avg_sq 7.2e-06 (both runs)
    assert max(killed_vs_ref.values()) <= 1e-4 and max(clean_vs_ref.values()) <= 1e-4, (killed_vs_ref, clean_vs_ref)
    assert max(killed_vs_clean.values()) <= 1e-6, killed_vs_clean
