"""Free-port picking under a parallel test run: each pytest-xdist worker (and what its
tests start, through the inherited environment) picks from its own slice of a range."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tpflex_proto.devtools.ports import free_ports, worker_slice


def test_outside_a_parallel_run_the_whole_range_is_used(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert worker_slice(20000, 32000, 20) == range(20000, 32000, 20)


@pytest.mark.parametrize("n", [2, 3, 7])
def test_the_workers_slices_are_disjoint_and_inside_the_range(monkeypatch, n):
    slices = []
    for k in range(n):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{k}")
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(n))
        slices.append(set(worker_slice(20000, 32000, 20)))
    full = set(range(20000, 32000, 20))
    assert all(s and s <= full for s in slices)
    assert sum(len(s) for s in slices) == len(set().union(*slices)) >= len(full) - n


@pytest.mark.parametrize("worker, count", [("gw5", "2"), ("gwx", "2"), ("gw0", "many")])
def test_odd_worker_variables_fall_back_to_the_whole_range(monkeypatch, worker, count):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", count)
    assert worker_slice(10000, 20000) == range(10000, 20000)


def test_a_process_started_by_a_worker_picks_from_that_workers_slice():
    env = {"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2"}
    code = "from tpflex_proto.devtools.ports import free_ports; print(*free_ports(20))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    ports = [int(p) for p in out.stdout.split()]
    assert len(set(ports)) == 20 and all(15000 <= p < 20000 for p in ports), ports
    assert free_ports(3)  # this process's own run still finds ports
