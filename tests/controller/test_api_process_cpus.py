"""``rest.cpus``: the REST child and every thread of it run on the configured CPUs; the
controller process stays where it was started; the CPU-list syntax round-trips."""

from __future__ import annotations

import os
import subprocess

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tpflex_controller.cpus import format_cpu_list, parse_cpu_list

from tests.controller.controller_harness import (
    CONTROLLER_BIN,
    ControllerProc,
    small_cluster,
)
from tests.support.procfs import status
from tests.support.wait import wait_until


def _allowed(pid: int, tid: int | None = None) -> frozenset[int]:
    return parse_cpu_list(status(pid, tid)["Cpus_allowed_list"])


def test_the_rest_child_and_all_its_threads_run_on_rest_cpus(etcd_server, etcd, tmp_path):
    mine = frozenset(os.sched_getaffinity(0))
    cpu = max(mine)  # a single CPU: on a machine of two, not the whole set
    small_cluster(etcd)
    proc = ControllerProc(etcd_server.endpoints, "c1", tmp_path, env={"TPFLEX_REST__CPUS": str(cpu)})
    try:
        proc.wait_http()
        [child] = proc.rest_pids()
        with httpx.Client(base_url=proc.rest_url, timeout=10) as http:
            wait_until(lambda: http.get("/v1/racks").status_code == 200, 15, "the child serves")
        tids = [int(t) for t in os.listdir(f"/proc/{child}/task")]
        assert len(tids) > 1  # uvicorn's, the informer's and the link's threads, not only main
        assert {t: _allowed(child, t) for t in tids} == {t: frozenset({cpu}) for t in tids}
        assert _allowed(proc.proc.pid) == mine  # the decision loop's process is not moved
    finally:
        proc.kill()


def test_a_cpu_the_machine_lacks_is_refused_by_the_process_with_exit_2():
    beyond = (os.cpu_count() or 1) + 7
    bad = subprocess.run([CONTROLLER_BIN], env={**os.environ, "TPFLEX_REST__CPUS": f"0,{beyond}"},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2, bad.stderr
    assert "rest.cpus" in bad.stderr and f"CPU {beyond} does not exist" in bad.stderr
    assert "Traceback" not in bad.stderr


@given(st.sets(st.integers(0, 300), min_size=1))
def test_a_cpu_list_round_trips_through_its_shortest_text(cpus):
    text = format_cpu_list(cpus)
    assert parse_cpu_list(text) == cpus
    assert len(text.split(",")) == sum(1 for c in cpus if c - 1 not in cpus)  # one item per run


@pytest.mark.parametrize("text", ["", ",", "1,", "a", "1-", "-1", "2-1", "1--3", "1-2-3", "0x1", "١"])
def test_bad_cpu_lists_are_refused_with_the_item(text):
    with pytest.raises(ValueError, match="CPU"):
        parse_cpu_list(text)
