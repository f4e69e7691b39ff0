"""The demo story with a Hugging Face model (``tpflex-demo --model DIR``): a tiny Llama
(4 KV groups, so the degraded replica holds them 2+1+1) follows the controller's plans
through a GPU failure (4+4 -> 4+3) and its repair, with loss parity against the HF model
trained in one process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tpflex_proto import keys, types_pb2
from tpflex_trainer.demo.model import demo_model
from tpflex_trainer.demo.story import JOB, Story, StoryConfig
from tpflex_trainer.demo.summary import summarize

from tests.e2e.support import etcd_history, free_base_port
from tests.trainer.hf_support import make_model_dir


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_short_demo_story_with_a_hf_model(tmp_path):
    # 8 rank processes each import torch and transformers: on 2 busy cores the first phase
    # alone can take a minute or two, hence the generous phase timeout
    model = make_model_dir(tmp_path / "llama", "llama", heads=8, kv=4)
    story = Story(StoryConfig(workdir=tmp_path / "w", base_port=free_base_port(), steps=44,
                              fail_at_step=6, repair_at_step=16, phase_timeout_s=150,
                              model_dir=str(model)))
    try:
        story.start()
        run = story.play()
        plans = etcd_history(story.cluster.etcd, keys.job_plan(JOB), types_pb2.Plan)
    finally:
        story.stop()
    assert [[r.tp_degree for r in sorted(p.replicas, key=lambda r: r.index)] for p in plans] == [[4, 4], [4, 3], [4, 4]]
    trained = {r["tp"] for r in run.records if r["kind"] == "step" and r["generation"] == 2}
    assert trained == {3, 4}
    summary = summarize(run, demo_model(str(model)))
    assert summary.steps == 44
    assert summary.parity_max_rel_diff <= 1e-5


def test_demo_refuses_a_model_it_cannot_map(tmp_path):
    (tmp_path / "m").mkdir()
    demo = str(Path(sys.executable).parent / "tpflex-demo")
    out = subprocess.run([demo, "--model", str(tmp_path / "m"), "--workdir", str(tmp_path / "w")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--model:" in out.stderr and "Traceback" not in out.stderr
