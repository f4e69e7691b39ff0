"""The demo's story, shortened, end to end: real etcd, controller and simulated agents
(processes), a real 8-process gloo job following the controller's plans through a GPU
failure (4+4 -> 4+3, rack 1 boosted) and its repair (back to 4+4)."""

from __future__ import annotations

import pytest
from tpflex_proto import codec, keys, types_pb2
from tpflex_trainer.demo.story import FAILED_GPU, JOB, Story, StoryConfig
from tpflex_trainer.demo.summary import summarize

from tests.e2e.support import PHASE_S, etcd_history, free_base_port, reference_for, rel_diff

RANK_OF_FAILED = 4 + FAILED_GPU[1]  # rank order = the spec's: rack 0's 4 GPUs, then rack 1's


def _plan_degrees(plan: types_pb2.Plan) -> list[int]:
    return [r.tp_degree for r in sorted(plan.replicas, key=lambda r: r.index)]


def _plan_gpus(plan: types_pb2.Plan) -> set[tuple[str, int]]:
    return {(g.node, g.index) for r in plan.replicas for st in r.stages for g in st.gpus}


@pytest.mark.slow
@pytest.mark.timeout(270)
def test_short_demo_story(tmp_path):
    # 40 steps after the repair: the job must still be training when the repaired GPU is
    # planned again (after the controller's 2 s flap hold-down)
    story = Story(StoryConfig(workdir=tmp_path, base_port=free_base_port(), steps=64,
                              fail_at_step=10, repair_at_step=24, phase_timeout_s=PHASE_S))
    try:
        story.start()
        run = story.play()
        etcd = story.cluster.etcd
        plans = etcd_history(etcd, keys.job_plan(JOB), types_pb2.Plan)
        acks = etcd_history(etcd, keys.job_acks(JOB), types_pb2.Ack)
        kv = etcd.get(keys.rack("rack-1"))
        rack1 = codec.decode(types_pb2.Rack, kv.value, kv.key)
    finally:
        story.stop()

    # plan generations 1, 2, 3: 4+4, 4+3 without the failed GPU, 4+4 again
    assert [p.generation for p in plans] == [1, 2, 3]
    assert [_plan_degrees(p) for p in plans] == [[4, 4], [4, 3], [4, 4]]
    assert FAILED_GPU not in _plan_gpus(plans[1])
    assert FAILED_GPU in _plan_gpus(plans[2]) and len(_plan_gpus(plans[2])) == 8
    assert run.started_after_repair == [FAILED_GPU]

    # the TP degree each rank trained at, per generation
    ran: dict[int, dict[int, set[int]]] = {}
    for r in run.records:
        if r["kind"] == "step":
            ran.setdefault(r["generation"], {}).setdefault(r["rank"], set()).add(r["tp"])
    assert sorted(ran) == [1, 2, 3]
    assert ran[1] == {rank: {4} for rank in range(8)}
    assert ran[2] == {**{rank: {4} for rank in range(4)},
                      **{rank: {3} for rank in range(4, 8) if rank != RANK_OF_FAILED}}
    assert ran[3] == {rank: {4} for rank in range(8)}

    # rack 1's caps as the simulated GPUs applied them: survivors boosted above TDP (within
    # the GPU's max) while degraded, nominal after the repair
    survivors = [i for i in range(4) if i != FAILED_GPU[1]]
    for i in survivors:
        assert rack1.gpu_tdp_w < run.caps_degraded[i] <= rack1.gpu_max_w, run.caps_degraded
    assert {i: run.caps_repaired[i] for i in range(4)} == {i: rack1.gpu_tdp_w for i in range(4)}

    # every rank acked every generation it trained at (the failed rank never acks g2)
    acked = {(a.rank, a.generation) for a in acks}
    for generation, ranks in ran.items():
        for rank in ranks:
            assert (rank, generation) in acked, f"rank {rank} did not ack generation {generation}"
    assert (RANK_OF_FAILED, 2) not in acked

    # loss parity with the single-process reference, on the run of each step that counts
    last: dict[int, dict] = {}  # a step re-run after a roll-back: its last run counts
    for r in sorted((r for r in run.records if r["kind"] == "step"), key=lambda r: r["t"]):
        last[r["step"]] = r
    assert sorted(last) == list(range(64))
    ref = reference_for({s: r["global_batch"] for s, r in last.items()})
    worst = max(rel_diff(last[s]["loss"], ref[s]) for s in last)
    assert worst <= 1e-5, worst

    summary = summarize(run)
    assert summary.parity_max_rel_diff <= 1e-5
    assert summary.violations() == [], summary.phases_failure
