"""The launcher path: after a whole-job restart, processes started fresh get the current
plan at start-up and load the latest checkpoint into its layout (4+3 after a GPU
failure), then train on with the reference run's losses. The other path (survivors
recovering in-process) is test_demo_story's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tpflex_trainer.demo.story import FAILED_GPU, Story, StoryConfig

from tests.e2e.support import PHASE_S, free_base_port, reference_for, rel_diff

STEPS, FAIL_AT, EVERY = 24, 6, 5  # the restart comes after step 3 * EVERY + 2, from step 15 (20 at most)


def _latest_checkpoint_step(directory: Path) -> int:
    name = (directory / "latest").read_text().strip()
    assert (directory / name / "meta.json").exists()  # complete (meta is written last)
    return int(name.removeprefix("step-"))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fresh_processes_load_the_checkpoint_into_the_current_layout(tmp_path):
    config = StoryConfig(workdir=tmp_path, base_port=free_base_port(), steps=STEPS,
                         fail_at_step=FAIL_AT, repair_at_step=STEPS - 1, checkpoint_every=EVERY,
                         phase_timeout_s=PHASE_S, preload=True)
    story = Story(config)
    try:
        story.start()
        story.wait_step(FAIL_AT, "training at 4+4")
        story.fail_gpu()
        plan = story.wait_plan(2)
        story.wait_step(3 * EVERY + 2, "training at 4+3 past a checkpoint")
        launcher = story.launcher
        for gpu in launcher.gpus():  # the whole job goes down
            launcher.kill_rank(gpu)
        resume = _latest_checkpoint_step(config.checkpoint_dir)
        t_restart = time.time()
        started = launcher.restart_all(plan)
        story.wait_done()
        records = launcher.records()
        failed = launcher.failed_ranks()
    finally:
        story.stop()

    assert failed == {}
    assert sorted(started) == sorted(g for g in launcher.gpus() if g != FAILED_GPU)
    before = [r for r in records if r["t"] < t_restart]
    after = [r for r in records if r["t"] >= t_restart]
    # the checkpoint was written in the 4+3 layout, after the failure
    first_degraded = min(r["step"] for r in before if r["kind"] == "step" and r["generation"] == 2)
    assert first_degraded < resume

    # every fresh process joined generation 2 from the checkpoint, at the checkpoint's step
    applied = [r for r in after if r["kind"] == "applied"]
    assert sorted(r["rank"] for r in applied) == [r for r in range(8) if r != 4 + FAILED_GPU[1]]
    assert {(r["generation"], r["source"], r["step"]) for r in applied} == {(2, "checkpoint", resume)}
    assert {r["rank"]: r["tp"] for r in applied} == {
        **{rank: 4 for rank in range(4)}, **{rank: 3 for rank in (4, 5, 7)}}

    # training went on from the checkpoint's step at 4+3, to the end
    steps_after = [r for r in after if r["kind"] == "step"]
    assert min(r["step"] for r in steps_after) == resume
    assert {r["step"] for r in steps_after} == set(range(resume, STEPS))
    assert {tuple(r["degrees"]) for r in steps_after} == {(4, 3)}

    # the losses from the checkpoint on are the reference run's
    first_before = {}
    for r in sorted((r for r in before if r["kind"] == "step"), key=lambda r: r["t"]):
        first_before[r["step"]] = r  # the last run of a step counts
    first_after = {}
    for r in sorted(steps_after, key=lambda r: r["t"]):
        first_after.setdefault(r["step"], r)
    table = {s: r for s, r in first_before.items() if s < resume} | first_after
    ref = reference_for({s: r["global_batch"] for s, r in table.items()})
    diffs = {s: rel_diff(first_after[s]["loss"], ref[s]) for s in sorted(first_after)}
    assert max(diffs.values()) <= 1e-5, diffs
