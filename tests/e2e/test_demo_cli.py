"""`tpflex-demo` refuses to start on taken ports (exit 2, the ports named, nothing started:
the console script as a process) and refuses an impossible story or a model directory it
cannot map (exit 2, the argument named: its entry point ``tpflex_trainer.demo.main:main``
called in this process, which has torch and transformers imported already; a process
would spend seconds importing them to print the same line)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tpflex_trainer.demo.cluster import DemoPorts
from tpflex_trainer.demo.main import main

from tests.e2e.support import free_base_port

DEMO = str(Path(sys.executable).parent / "tpflex-demo")


def _demo(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([DEMO, *args], capture_output=True, text=True, timeout=timeout)


def test_demo_on_taken_ports_says_so_and_exits_2(tmp_path):
    ports = DemoPorts(free_base_port())
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", ports.trainer))
        taken.listen()
        out = _demo("--base-port", str(ports.base), "--workdir", str(tmp_path / "w"))
    assert out.returncode == 2, out.stderr
    assert f"ports already in use on 127.0.0.1: {ports.trainer}" in out.stderr
    assert "--base-port" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "w" / "cluster" / "etcd").exists()  # nothing was started


def _refused(capsys, *args: str) -> str:
    """``tpflex-demo ARGS`` in this process: it must exit 2 (argparse's error); its stderr."""
    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_demo_refuses_an_impossible_story(tmp_path, capsys):
    err = _refused(capsys, "--steps", "50", "--fail-at", "40", "--repair-at", "20", "--workdir", str(tmp_path))
    assert "need 0 < --fail-at < --repair-at < --steps" in err
    assert not tmp_path.joinpath("cluster").exists()


def test_demo_refuses_a_model_it_cannot_map(tmp_path, capsys):
    """``tpflex-demo --model DIR`` (the demo story with a Hugging Face model runs in
    test_demo_story, in the same cluster run as its TLS and token checks)."""
    (tmp_path / "m").mkdir()
    err = _refused(capsys, "--model", str(tmp_path / "m"), "--workdir", str(tmp_path / "w"))
    assert "--model:" in err and not (tmp_path / "w").exists()
