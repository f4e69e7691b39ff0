"""The controller under a system-call filter that denies what its REST child does to
itself (setpriority for rest.nice, sched_setaffinity for rest.cpus), as a systemd unit's
``SystemCallFilter=~@resources`` does: the default configuration still serves REST (the
niceness is skipped with a warning), and an explicit rest.cpus that cannot be applied is
refused at start with exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.controller.controller_harness import (
    CONTROLLER_BIN,
    ControllerProc,
    small_cluster,
)
from tests.support import seccomp_deny
from tests.support.procfs import nice
from tests.support.wait import wait_until

pytestmark = pytest.mark.skipif(not seccomp_deny.supported(), reason="needs x86-64 Linux and asm/unistd_64.h")
DENY = [sys.executable, str(Path(seccomp_deny.__file__)), "setpriority,sched_setaffinity", "--"]


def test_rest_serves_when_the_sandbox_denies_its_niceness(etcd_server, etcd, tmp_path):
    small_cluster(etcd)
    proc = ControllerProc(etcd_server.endpoints, "c1", tmp_path, prefix=DENY)  # rest.nice: default 10
    try:
        proc.wait_http()
        with httpx.Client(base_url=proc.rest_url, timeout=10) as http:
            wait_until(lambda: http.get("/v1/racks").status_code == 200, 15, "the REST child serves")
        [child] = proc.rest_pids()  # started once: no crash and restart
        assert nice(child) == nice(proc.proc.pid)  # the filter held: the niceness was not applied
        wait_until(lambda: "rest.nice not applied" in proc.log_path.read_text(), 10, "the warning")
        assert "Operation not permitted" in proc.log_path.read_text()
    finally:
        proc.kill()


def test_rest_cpus_the_sandbox_denies_is_refused_at_start_with_exit_2():
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TPFLEX_")}, "TPFLEX_REST__CPUS": "0"}
    bad = subprocess.run([*DENY, CONTROLLER_BIN], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2, bad.stderr
    assert "rest.cpus" in bad.stderr and "may not run on CPUs 0: Operation not permitted" in bad.stderr
    assert "Traceback" not in bad.stderr
