"""deploy/slurm/make-job-spec.py with hostile arguments: each exits 2 with a message naming
the argument and no traceback, and writes no spec (its docstring: "Bad arguments exit 2").
Found by review: a --rack-pattern with an attribute gave a traceback; a compressed Slurm
node list, the same node twice, a unit family twice and a job name with '/' were written
with exit 0; --gpus-per-node had no bound (a huge one was OOM-killed, so only a value just
above the bound is run here; for the same reason the too-wide rack format is a small one)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.deploy.tools import DEPLOY

SCRIPT = DEPLOY / "slurm" / "make-job-spec.py"


def make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=30,
                          check=False)


@pytest.mark.parametrize("args, message", [
    (["--nodes", "node[01-03,x]"], "--nodes: node name 'node[01-03' must be 1-63 letters"),
    (["--nodes", "node[01-03,x]"], "scontrol show hostnames"),
    (["--nodes", "a/b"], "--nodes: node name 'a/b' must be"),
    (["--nodes", "a b a"], "--nodes: node 'a' is given twice"),
    (["--nodes", "a,a"], "--nodes: node 'a' is given twice"),
    (["--units", "heads=8,heads=4"], "argument --units: unit family 'heads' given twice"),
    (["--name", "my job/1"], "--name: job name 'my job/1' must be 1-128 letters"),
    (["--name", ""], "--name: job name '' must be"),
    (["--rack-pattern", "{node.x}"], "--rack-pattern: cannot use '{node.x}'"),
    (["--rack-pattern", "{node[99]}"], "--rack-pattern: cannot use '{node[99]}'"),
    (["--rack-pattern", "{domain[0]}"], "--rack-pattern: cannot use '{domain[0]}'"),
    (["--rack-pattern", "{rack}"], "--rack-pattern: cannot use '{rack}'"),
    (["--rack-pattern", "r{"], "--rack-pattern: cannot use 'r{'"),
    (["--rack-pattern", "{node:>99999}"], "--rack-pattern: cannot use '{node:>99999}'"),
    (["--rack-pattern", "rack/{domain}"], "--rack-pattern: rack name 'rack/0' must be"),
    (["--gpus-per-node", "1025"], "--gpus-per-node: 1025 is not within 1..1024"),
    (["--local-batch", "99999999999999999999999"], "--local-batch: "),
])
def test_bad_input_exits_2_naming_the_argument(args, message):
    base = {"--name": "j", "--nodes": "a b", "--units": "heads=8", "--gpus-per-node": "2"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    p = make(*[x for kv in base.items() for x in kv])
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, (args, p.returncode, p.stderr)
    assert p.stdout == "", p.stdout


def test_good_input_of_the_same_kinds_is_written():
    p = make("--name", "llm-7b.v2", "--nodes", "gpu-a,gpu-b gpu-c gpu-d", "--gpus-per-node", "2",
             "--nodes-per-domain", "2", "--rack-pattern", "nvl{domain:02d}-{node}", "--units", "heads=8,ffn=16")
    assert p.returncode == 0, p.stderr
    spec = json.loads(p.stdout)
    assert [st["rack"] for r in spec["replicas"] for st in r["stages"]] == ["nvl00-gpu-a", "nvl01-gpu-c"]
    assert spec["baseTp"] == 4 and [u["name"] for u in spec["units"]] == ["heads", "ffn"]
