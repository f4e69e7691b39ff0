"""``tpflex-demo --pp 2``'s story end to end: real etcd, controller and 4 simulated agents
(4 racks x 2 GPUs), a real 8-process gloo job of 2 replicas x PP 2 x TP 2 following the
controller's plans through the failure of a GPU of one stage (only that stage drops to TP
1) and its repair; loss parity with the single-process reference. The 8 ranks are forked
from the launcher's zygote; the repaired GPU's new process is started with Popen (the
demo launcher's plain path, joining a running job)."""

from __future__ import annotations

from subprocess import Popen

import pytest
from tpflex_proto import keys, types_pb2
from tpflex_trainer.demo.story import JOB, TOPOLOGIES, Story, StoryConfig
from tpflex_trainer.demo.summary import render, summarize
from tpflex_trainer.launch.zygote import ZygoteProc

from tests.e2e.support import PHASE_S, etcd_history, free_base_port, phase_report

TOPO = TOPOLOGIES[2]
STEPS = 32  # the job holds at step 25 (repair + 1) until the repair's plan, then trains 7 more
# rank order = the spec's: replica 0 (rack-0, rack-1), replica 1 (rack-2, rack-3), 2 GPUs each
RANK_OF_FAILED = 6 + TOPO.failed_gpu[1]
SURVIVOR = 6 + 1 - TOPO.failed_gpu[1]  # the other GPU of the failed stage
PEER_STAGE = {2, 3}  # the same stage (1) of the other replica


def _rank(replica: int, slot: int, stage: int) -> int:
    return 4 * replica + 2 * stage + slot


def _stage_degrees(plan: types_pb2.Plan) -> list[list[int]]:
    return [[st.tp_degree for st in sorted(r.stages, key=lambda st: st.spec_stage)]
            for r in sorted(plan.replicas, key=lambda r: r.index)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_pp2_one_stage_fails_and_is_repaired(tmp_path, monkeypatch):
    monkeypatch.setenv("TPFLEX_LOG_LEVEL", "INFO")  # the ranks' logs, for a phase that took too long
    story = Story(StoryConfig(workdir=tmp_path, base_port=free_base_port(), steps=STEPS,
                              fail_at_step=10, repair_at_step=24, phase_timeout_s=PHASE_S, pp=2,
                              preload=True))
    try:
        story.start()
        story.launcher.fork_new_ranks = False  # the repaired GPU's process: Popen
        run = story.play()
        plans = etcd_history(story.cluster.etcd, keys.job_plan(JOB), types_pb2.Plan)
    finally:
        story.stop()

    assert [p.generation for p in plans] == [1, 2, 3]
    assert [_stage_degrees(p) for p in plans] == [[[2, 2], [2, 2]], [[2, 2], [2, 1]], [[2, 2], [2, 2]]]
    assert run.started_after_repair == [TOPO.failed_gpu]
    started_by = {gpu: type(proc) for gpu, proc in story.launcher.procs.items()}
    assert started_by == {gpu: Popen if gpu == TOPO.failed_gpu else ZygoteProc for gpu in story.launcher.gpus()}

    ran: dict[int, dict[int, set[int]]] = {}  # generation -> rank -> TP degrees of its stage
    for r in run.records:
        if r["kind"] == "step":
            ran.setdefault(r["generation"], {}).setdefault(r["rank"], set()).add(r["tp"])
    assert ran[1] == {rank: {2} for rank in range(8)}
    assert ran[2] == {**{rank: {2} for rank in range(6)}, SURVIVOR: {1}}
    assert ran[3] == {rank: {2} for rank in range(8)}

    # the failure moves units only into the failed stage, from the same stage of replica 0.
    # Rarely, the kill lands between members' optimizer updates (a torn step): a member left
    # a step behind holds nothing and is sent its units again, only from its own stage
    applied = [r for r in run.records if r["kind"] == "applied" and r["generation"] == 2]
    behind = {tuple(m) for m in applied[0]["behind"]}
    assert all({tuple(m) for m in r["behind"]} == behind for r in applied), applied  # every rank agrees
    behind_ranks = {_rank(*m) for m in behind}
    allowed = PEER_STAGE | {_rank(replica, slot, stage) for _, _, stage in behind
                            for replica in (0, 1) for slot in (0, 1)}
    senders = {r["rank"] for r in applied if r["bytes_sent"] > 0}
    assert senders and senders <= allowed - behind_ranks - {RANK_OF_FAILED}, (senders, behind)
    assert all(r["peer_units"] > 0 and r["source"] == "live" for r in applied)

    # NTP-PW boosts only the degraded stage's rack (its surviving GPU)
    assert run.failed_rack == "rack-3"
    assert run.caps_degraded[1 - TOPO.failed_gpu[1]] > 700.0

    summary = summarize(run)
    assert summary.steps == STEPS
    assert summary.parity_max_rel_diff <= 1e-5
    assert summary.violations() == [], phase_report(summary, tmp_path)
    assert "g2: 2/2+2/1" in render(summary, run)
