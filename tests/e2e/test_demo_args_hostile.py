"""`tpflex-demo` on a hostile --model config.json or --workdir, as the console script in
a process: exit 2 with the option named on one line, no traceback, nothing started (no
cluster directory in the workdir). The process runs under a 4 GB address-space limit so
that a regression cannot take the machine's memory."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.refusal import refused

DEMO = str(Path(sys.executable).parent / "tpflex-demo")
LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "num_attention_heads": 8,
         "num_key_value_heads": 8, "intermediate_size": 128, "num_hidden_layers": 2}


def _refused(*args: str) -> str:
    return refused([DEMO, *args], timeout=120).strip().splitlines()[-1]  # the old code built the model first


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"num_attention_heads": "eight"}, "num_attention_heads"),
        ({"hidden_size": -64, "num_hidden_layers": -1}, "positive integer"),
        ({"vocab_size": 10**12, "hidden_size": 10**6, "intermediate_size": 10**9,
          "num_hidden_layers": 10**6}, "1,000,000,000"),
    ],
    ids=["wrong-type", "negative", "huge"],
)
def test_demo_refuses_a_bad_model_config(changes, words, tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({**LLAMA, **changes}))
    line = _refused("--model", str(tmp_path / "m"), "--workdir", str(tmp_path / "w"))
    assert line.startswith("tpflex-demo: error: --model: ") and words in line, line
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("sub", ["sub"], ids=["under-a-file"])  # the path's parent is a file
def test_demo_refuses_a_workdir_it_cannot_write(sub, tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    line = _refused("--workdir", str(f / sub) if sub else str(f), "--steps", "20", "--fail-at", "5",
                    "--repair-at", "10")
    assert line.startswith("tpflex-demo: error: --workdir: "), line
    assert f.read_text() == ""
