"""``tpflex-demo --model DIR`` refuses a model directory it cannot map. The demo story
with a Hugging Face model (a tiny Llama with 4 KV groups following the controller's plans
through a GPU failure, 4+4 -> 4+3 holding them 2+1+1, and its repair, with loss parity
against the HF model trained in one process) runs in test_demo_story, in the same
cluster run as its TLS and token checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_demo_refuses_a_model_it_cannot_map(tmp_path):
    (tmp_path / "m").mkdir()
    demo = str(Path(sys.executable).parent / "tpflex-demo")
    out = subprocess.run([demo, "--model", str(tmp_path / "m"), "--workdir", str(tmp_path / "w")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--model:" in out.stderr and "Traceback" not in out.stderr
