"""The REST API in its own process: a real tpflex-controller spawns it, it serves the
controller's metrics and reads through its own informer, it is restarted when it dies
(the decision loop keeps deciding meanwhile) and stopped with the controller."""

from __future__ import annotations

import os
import signal

import httpx

from tests.controller.controller_harness import (
    ControllerProc,
    PlanWatcher,
    fail_gpu,
    put_job,
    small_cluster,
)
from tests.support.wait import wait_until


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _ready(http: httpx.Client) -> bool:
    try:
        return http.get("/readyz").status_code == 200
    except httpx.HTTPError:
        return False


def test_rest_child_is_supervised_and_decisions_go_on_without_it(etcd_server, etcd, tmp_path):
    racks = small_cluster(etcd)
    put_job(etcd, racks)
    watcher = PlanWatcher(etcd, "job1")
    proc = ControllerProc(etcd_server.endpoints, "c1", tmp_path)
    try:
        proc.wait_http()
        watcher.wait_generation(1, timeout=20)
        [child] = proc.rest_pids()
        assert child != proc.proc.pid and _alive(child)
        with httpx.Client(base_url=proc.rest_url, timeout=10) as http:
            wait_until(lambda: _ready(http), 10, "readyz 200")
            # the decision loop's metrics, served by the child through the link
            wait_until(lambda: proc.metric("tpflex_plan_generation") == 1.0, 10, "plan metric")
            assert http.get("/v1/jobs/job1/plan").json()["generation"] == 1

            os.kill(child, signal.SIGKILL)  # REST dies; the controller must go on deciding
            fail_gpu(etcd, "rack1-n00", 2, {1})
            second = watcher.wait_generation(2, timeout=20)
            assert second.cause == "gpu_failed"
            assert proc.proc.poll() is None

            pids = wait_until(lambda: len(p := proc.rest_pids()) == 2 and p, 15, "the REST child restarted")
            assert pids[1] != child and _alive(pids[1])
            wait_until(lambda: _ready(http), 15, "readyz 200 after the restart")
            assert http.get("/v1/jobs/job1/plan").json()["generation"] == 2
            assert "rest process exited; restarting" in proc.log_path.read_text()
        assert proc.terminate() == 0
        wait_until(lambda: not _alive(pids[1]), 10, "the REST child stopped with the controller")
    finally:
        watcher.close()
        proc.kill()


def test_rest_child_exits_when_the_controller_is_killed(etcd_server, etcd, tmp_path):
    proc = ControllerProc(etcd_server.endpoints, "c1", tmp_path)
    try:
        proc.wait_http()
        [child] = proc.rest_pids()
        proc.kill()  # SIGKILL: no clean stop; the child must not outlive its parent
        wait_until(lambda: not _alive(child), 10, "orphaned REST child exited")
    finally:
        proc.kill()


def test_rest_child_started_just_before_the_controller_dies_exits(etcd_server, tmp_path):
    """The controller is killed while its child is still starting (before the child
    could ask to be signalled when its parent dies): the child must not stay behind."""
    proc = ControllerProc(etcd_server.endpoints, "c1", tmp_path)
    try:
        [child] = wait_until(lambda: proc.rest_pids(), 30, "the REST child spawned")
        proc.kill()
        wait_until(lambda: not _alive(child), 15, "the REST child of a killed controller exited")
    finally:
        proc.kill()
