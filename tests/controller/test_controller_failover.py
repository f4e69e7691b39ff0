"""Two real tpflex-controller processes: exactly one acts; kill -9 the leader and the
other leads within TTL + 1 s; the generation history has no gap and no duplicate."""

from __future__ import annotations

from tpflex_proto import codec, keys, types_pb2

from tests.controller.controller_harness import (
    ControllerProc,
    PlanWatcher,
    eventually,
    fail_gpu,
    put_job,
    small_cluster,
    wait_leader,
)

TTL = 2


def _history(etcd, job: str) -> list[int]:
    kvs, _ = etcd.get_prefix(keys.job_plan_history(job, 0)[:-12])
    return [codec.decode(types_pb2.Plan, kv.value).generation for kv in kvs]


def test_kill_leader_standby_takes_over_without_losing_a_generation(etcd_server, etcd, tmp_path):
    racks = small_cluster(etcd)
    put_job(etcd, racks)
    watcher = PlanWatcher(etcd, "job1")
    procs = {n: ControllerProc(etcd_server.endpoints, n, tmp_path, ttl=TTL) for n in ("ca", "cb")}
    try:
        for p in procs.values():
            p.wait_http()
        first, _ = wait_leader(etcd)
        watcher.wait_generation(1, timeout=20)
        leader, standby = procs[first], procs["cb" if first == "ca" else "ca"]
        assert leader.metric("tpflex_controller_is_leader") == 1.0
        assert standby.metric("tpflex_controller_is_leader") == 0.0

        fail_gpu(etcd, "rack0-n01", 2, {0})
        watcher.wait_generation(2)
        # only the leader decided (the standby follows the plans, commits nothing)
        eventually(lambda: standby.metric("tpflex_plan_generation") == 2.0)
        eventually(lambda: leader.metric_sum("tpflex_reconfigurations_total") == 2.0)
        assert standby.metric_sum("tpflex_reconfigurations_total") == 0.0

        leader.kill()
        killed_at = __import__("time").monotonic()
        # a change while nobody leads: the new leader must pick it up
        fail_gpu(etcd, "rack0-n01", 2, set(), seq=2)
        second, led_at = wait_leader(etcd, other_than=first, timeout=TTL + 5)
        assert second == standby.name
        assert led_at - killed_at <= TTL + 1.0, f"takeover took {led_at - killed_at:.2f}s"

        third = watcher.wait_generation(3, timeout=10)
        assert third.cause in ("gpu_recovered", "resync")
        assert [r.tp_degree for r in third.replicas] == [4, 4]
        fail_gpu(etcd, "rack1-n00", 2, {1}, seq=3)
        watcher.wait_generation(4)
        assert _history(etcd, "job1") == [1, 2, 3, 4]
        assert [p.generation for p in watcher.plans] == [1, 2, 3, 4]
        assert standby.metric("tpflex_controller_is_leader") == 1.0
        assert standby.terminate() == 0  # graceful SIGTERM
    finally:
        watcher.close()
        for p in procs.values():
            p.kill()
