"""What another client writes into etcd, and history the controller missed: malformed values
in every key family are skipped with a log line (a real controller process keeps deciding),
and a watch that must resume past a compaction re-reads the state and still decides."""

from __future__ import annotations

import httpx
import pytest
from tpflex_proto import keys

from tests.agent.support import wait_until
from tests.controller.controller_harness import (
    ControllerProc,
    PlanWatcher,
    fail_gpu,
    put_job,
    small_cluster,
)
from tests.reliability.fleet import Stopwatch, record
from tests.reliability.proxy import CuttableProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

GARBAGE = b"\x0a\xff\xff\xff\x12\x05not-a-protobuf\xfe"
MALFORMED_KEYS = [
    keys.rack("rack-bad"), keys.node("node-bad"), keys.health("rack0-n00"),
    keys.job_spec("job-bad"), keys.job_plan("job-bad"), keys.job_ack("job1", 3),
    keys.gpu_override("rack1-n00", 0), keys.job_override("job1"), keys.power("rack0-n01"),
]


def test_malformed_values_from_another_client_are_skipped_with_a_log_line(etcd_server, etcd, tmp_path):
    racks = small_cluster(etcd)
    put_job(etcd, racks)
    watcher = PlanWatcher(etcd, "job1")
    ctl = ControllerProc(etcd_server.endpoints, "c1", tmp_path)
    try:
        ctl.wait_http()
        watcher.wait_generation(1, timeout=20)
        for key in MALFORMED_KEYS + [keys.event(999)]:
            etcd.put(key, GARBAGE)
        wait_until(lambda: all(f"key={k} " in ctl.log_path.read_text() for k in MALFORMED_KEYS), 10,
                   "a log line for every malformed value")
        for path in ("/v1/racks", "/v1/nodes", "/v1/gpus", "/v1/jobs", "/v1/jobs/job1/plan",
                     "/v1/events", "/v1/status"):
            resp = httpx.get(ctl.rest_url + path, timeout=5)
            assert resp.status_code < 500, (path, resp.text)
        fail_gpu(etcd, "rack1-n01", 2, {1})  # the loop still decides
        plan = watcher.wait_generation(2)
        assert plan.cause == "gpu_failed" and [r.tp_degree for r in plan.replicas] == [4, 3]
        assert ctl.proc.poll() is None and "Traceback" not in ctl.log_path.read_text()
    finally:
        watcher.close()
        ctl.kill()
    record("etcd_malformed_values", f"garbage bytes written by another client into {len(MALFORMED_KEYS) + 1} "
           "key families (rack, node, health, job spec, plan, ack, GPU and job override, power, event)",
           "one 'skipping malformed etcd ...' log line per key; REST reads answer < 500; no traceback; "
           "a later GPU failure is planned", {"keys": len(MALFORMED_KEYS) + 1})


def test_watch_resumes_past_a_compaction_by_re_reading(etcd_server, etcd, tmp_path):
    racks = small_cluster(etcd)
    put_job(etcd, racks)
    watcher = PlanWatcher(etcd, "job1")
    proxy = CuttableProxy(etcd_server.endpoints[0])
    ctl = ControllerProc([proxy.endpoint], "c1", tmp_path, ttl=5)
    try:
        ctl.wait_http()
        watcher.wait_generation(1, timeout=20)
        proxy.cut()  # the controller cannot see etcd
        fail_gpu(etcd, "rack0-n00", 2, {0})
        for i in range(20):
            etcd.put(f"/tpflex/v1/scratch/{i}", b"x")
        rev = etcd.put("/tpflex/v1/scratch/last", b"x")
        etcd.compact(rev)  # the history the controller's watch needs is gone
        sw = Stopwatch()
        proxy.heal()
        plan = watcher.wait_generation(2, timeout=20)
        resync_ms = sw.ms()
        assert [r.tp_degree for r in plan.replicas] == [3, 4]
        wait_until(lambda: "etcd history compacted" in ctl.log_path.read_text(), 5, "resync log line")
        assert ctl.proc.poll() is None
    finally:
        watcher.close()
        ctl.kill()
        proxy.close()
    record("etcd_compaction_resync", "controller cut from etcd (TCP proxy); a GPU fails; etcd history "
           "compacted past the controller's watch; connection restored",
           "the watch reports the compaction, the controller re-reads the state and commits the plan",
           {"heal_to_commit_ms": resync_ms})
