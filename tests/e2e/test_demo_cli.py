"""`tpflex-demo` refuses to start on taken ports (exit 2, the ports named, nothing started)
and refuses an impossible story (exit 2)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from tpflex_trainer.demo.cluster import DemoPorts

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


def test_demo_refuses_an_impossible_story(tmp_path):
    out = _demo("--steps", "50", "--fail-at", "40", "--repair-at", "20", "--workdir", str(tmp_path))
    assert out.returncode == 2
    assert "need 0 < --fail-at < --repair-at < --steps" in out.stderr and "Traceback" not in out.stderr
