"""The launcher's pure decisions: node identity precedence, the restart policy (checked
against its definition by simulation), GPU lists, CUDA indices and the exit status."""

from __future__ import annotations

import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tpflex_trainer.launch.devices import LocalGpu, parse_gpu_list
from tpflex_trainer.launch.env import cuda_device_for
from tpflex_trainer.launch.identity import IdentityError, resolve_node
from tpflex_trainer.launch.policy import (
    RestartPolicy,
    decide,
    describe_exit,
    launcher_status,
)

SLURM = {"SLURM_JOB_ID": "1", "SLURMD_NODENAME": "gpu-a", "SLURM_STEP_TASKS_PER_NODE": "1(x16)"}
K8S = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "NODE_NAME": "gpu-b"}


def test_node_precedence_argument_slurm_kubernetes_hostname():
    assert resolve_node("arg", {**SLURM, **K8S}).name == "arg"
    assert resolve_node(None, {**SLURM, **K8S}) .source == "slurm"
    assert resolve_node(None, K8S).name == "gpu-b"
    found = resolve_node(None, {}, hostname="host-7.cluster.example")
    assert (found.name, found.source) == ("host-7", "hostname")


@pytest.mark.parametrize("tasks", ["2", "1,2", "1(x3),2(x1)"])
def test_more_than_one_srun_task_per_node_is_refused(tasks):
    with pytest.raises(IdentityError, match="one task per node"):
        resolve_node(None, {**SLURM, "SLURM_STEP_TASKS_PER_NODE": tasks})


def test_unreadable_slurm_layout_and_bad_names_are_refused():
    with pytest.raises(IdentityError, match="cannot read"):
        resolve_node(None, {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "x"})
    with pytest.raises(IdentityError, match="must be 1-63"):
        resolve_node("a/b", {})
    with pytest.raises(IdentityError, match="NODE_NAME"):
        resolve_node(None, {"KUBERNETES_SERVICE_HOST": "x"})


@settings(max_examples=300, deadline=None)
@given(
    max_restarts=st.integers(1, 5), window=st.floats(1, 100), backoff=st.floats(0.01, 5),
    backoff_max=st.floats(0.01, 60),
    gaps=st.lists(st.floats(0, 50), min_size=1, max_size=40),
)
def test_restart_policy_never_exceeds_its_bound_in_any_window(max_restarts, window, backoff, backoff_max, gaps):
    """Simulate a rank that dies ``gap`` seconds after each (re)start; check the decisions
    against the policy's definition, computed here independently."""
    policy = RestartPolicy(max_restarts, window, backoff, backoff_max)
    restarts: list[float] = []
    now = 0.0
    for gap in gaps:
        now += gap
        d = decide(policy, restarts, now)
        in_window = [t for t in restarts if now - t < window]
        assert d.restart == (len(in_window) < max_restarts)
        if not d.restart:
            break
        assert d.delay_s == pytest.approx(min(backoff * 2 ** len(in_window), backoff_max))
        now += d.delay_s
        restarts.append(now)
    for t in restarts:  # no window of length `window` holds more than max_restarts restarts
        assert sum(1 for u in restarts if t <= u < t + window) <= max_restarts


def test_exit_descriptions_and_the_launcher_status():
    assert describe_exit(-signal.SIGKILL) == "signal:SIGKILL" and describe_exit(3) == "exit:3"
    assert launcher_status([0, 0]) == 0
    assert launcher_status([0, -signal.SIGTERM, 4]) == 143
    assert launcher_status([0, 4, -9]) == 4


@pytest.mark.parametrize("text, expected", [("0", [0]), ("3,1,1", [1, 3]), ("0-3", [0, 1, 2, 3]),
                                             ("0-1, 6", [0, 1, 6])])
def test_gpu_lists(text, expected):
    assert parse_gpu_list(text) == expected


@pytest.mark.parametrize("text", ["", "a", "1-", "-1", "3-1", "1024", "0-2000"])
def test_bad_gpu_lists(text):
    with pytest.raises(ValueError):
        parse_gpu_list(text)


def test_cuda_index_under_an_inherited_visibility_list():
    gpu = LocalGpu(5, "GPU-abc")
    assert cuda_device_for(gpu, None) == 5 and cuda_device_for(gpu, " ") == 5
    assert cuda_device_for(gpu, "4,5") == 1
    assert cuda_device_for(gpu, "GPU-x,GPU-abc") == 1
    with pytest.raises(ValueError, match="does not include GPU 5"):
        cuda_device_for(gpu, "0,1")
