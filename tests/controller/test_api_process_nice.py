"""``rest.nice``: the REST child runs at the configured niceness above the controller's
(the decision loop is scheduled first under CPU contention) and still serves."""

from __future__ import annotations

import httpx

from tests.controller.controller_harness import ControllerProc, small_cluster
from tests.support.procfs import nice
from tests.support.wait import wait_until


def test_rest_child_runs_at_the_configured_niceness(etcd_server, etcd, tmp_path):
    small_cluster(etcd)
    proc = ControllerProc(etcd_server.endpoints, "c1", tmp_path, env={"TPFLEX_REST__NICE": "7"})
    try:
        proc.wait_http()
        [child] = proc.rest_pids()
        assert nice(child) == min(19, nice(proc.proc.pid) + 7)
        with httpx.Client(base_url=proc.rest_url, timeout=10) as http:
            wait_until(lambda: http.get("/v1/racks").status_code == 200, 15, "the child serves")
    finally:
        proc.kill()
