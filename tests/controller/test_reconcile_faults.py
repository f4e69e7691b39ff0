"""The reconcile loop under lapsed node leases, bad input in etcd, an etcd restart, and
the rollout's ack phase."""

from __future__ import annotations

import time

from tpflex_controller import synthetic
from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.etcd import Etcd

from tests.controller.controller_harness import (
    PlanWatcher,
    controller_on_job,
    eventually,
    fail_gpu,
    put_job,
    small_cluster,
    start_controller,
)


def _events(etcd, kind: str) -> list[types_pb2.Event]:
    kvs, _ = etcd.get_prefix(keys.EVENTS)
    evs = [codec.decode(types_pb2.Event, kv.value) for kv in kvs]
    return [e for e in evs if e.kind == kind]


def test_node_whose_lease_lapses_counts_as_failed(etcd_server, etcd):
    lease = etcd.grant_lease(1)
    with controller_on_job(etcd_server, etcd, lease=lease) as (racks, watcher, ctl):
        watcher.wait_generation(1)
        # every node but rack1-n01 keeps its registration alive on its own lease
        for r in racks:
            for n in r.nodes:
                if n != "rack1-n01":
                    reg = synthetic.node(n, r.name, r.gpus_per_node)
                    etcd.put(keys.node(n), codec.encode(reg))
        lost = watcher.wait_generation(2, timeout=10)  # the 1 s lease lapses unrefreshed
        assert lost.cause == "node_lost"
        assert [r.tp_degree for r in lost.replicas] == [4, 2]
        used = {g.node for s in lost.replicas[1].stages for g in s.gpus}
        assert used == {"rack1-n00"}
        etcd.put(keys.node("rack1-n01"), codec.encode(synthetic.node("rack1-n01", "rack1", 2)))
        back = watcher.wait_generation(3)
        assert back.cause == "node_joined" and [r.tp_degree for r in back.replicas] == [4, 4]


def test_bad_input_is_logged_and_skipped_and_unplannable_jobs_get_an_event(etcd_server, etcd, caplog):
    racks = small_cluster(etcd)
    etcd.put(keys.health("rack0-n00"), b"\xff\xfe not a protobuf")
    etcd.put(keys.rack("garbage"), b"\x0a\xff\xff\xff")
    bad = synthetic.job("broken", ["no-such-rack"], 4)
    etcd.put(keys.job_spec("broken"), codec.encode(bad))
    put_job(etcd, racks)
    watcher = PlanWatcher(etcd, "job1")
    ctl = start_controller(etcd_server.endpoints)
    try:
        watcher.wait_generation(1)
        deadline = time.monotonic() + 10
        while not _events(etcd, "plan_failed") and time.monotonic() < deadline:
            time.sleep(0.05)
        failed = _events(etcd, "plan_failed")
        assert [e.job for e in failed] == ["broken"]
        assert "unknown rack 'no-such-rack'" in failed[0].reasons[0]
        assert etcd.get(keys.job_plan("broken")) is None
        assert "skipping malformed etcd value" in caplog.text
        # more garbage while running, then a real failure: the loop is still deciding
        etcd.put(keys.job_override("job1"), b"\x12\x05\xff\xff\xff")
        fail_gpu(etcd, "rack0-n01", 2, {0})
        assert watcher.wait_generation(2).cause == "gpu_failed"
        # the same bad spec is not reported again on every pass
        assert len(_events(etcd, "plan_failed")) == 1
        eventually(lambda: ctl.registry.get_sample_value("tpflex_unplannable_jobs") == 1.0)
    finally:
        ctl.stop()
        watcher.close()


def test_controller_recovers_when_etcd_returns(etcd_server, etcd):
    racks = small_cluster(etcd)
    put_job(etcd, racks)
    ctl = start_controller(etcd_server.endpoints, ttl=5)
    try:
        PlanWatcher(etcd, "job1").wait_generation(1)
        etcd_server.members[0].stop()
        time.sleep(1.0)  # etcd is down for a while (nothing to wait for)
        etcd_server.restart_member(0)
        client = Etcd(etcd_server.endpoints)
        deadline = time.monotonic() + 10  # the first calls after a restart may be reset
        while not client.healthy() and time.monotonic() < deadline:
            time.sleep(0.05)
        watcher = PlanWatcher(client, "job1")
        fail_gpu(client, "rack1-n00", 2, {0, 1})
        plan = watcher.wait_generation(2, timeout=20)
        assert [r.tp_degree for r in plan.replicas] == [4, 2]
        assert ctl.reconciler._thread.is_alive()
        watcher.close()
        client.close()
    finally:
        ctl.stop()


def test_all_ranks_acked_completes_the_rollout(etcd_server, etcd):
    with controller_on_job(etcd_server, etcd) as (_, watcher, ctl):
        watcher.wait_generation(1)
        fail_gpu(etcd, "rack1-n00", 2, {0})
        watcher.wait_generation(2)
        for rank in range(7):  # 4 + 3 ranks in use
            ack = types_pb2.Ack(job="job1", rank=rank, generation=2, acked_at=time.time())
            etcd.put(keys.job_ack("job1", rank), codec.encode(ack))
        deadline = time.monotonic() + 10
        phases: set[str] = set()
        while "acked" not in phases and time.monotonic() < deadline:
            ev = [e for e in _events(etcd, "plan_committed") if e.generation == 2]
            phases = {p.phase for p in ev[0].phases} if ev else set()
            time.sleep(0.05)
        assert {"detected", "committed", "acked"} <= phases
        assert ctl.registry.get_sample_value("tpflex_reconfiguration_seconds_count", {"phase": "acked"}) == 1.0


def test_event_log_stays_bounded_and_generations_contiguous(etcd_server, etcd):
    with controller_on_job(etcd_server, etcd, event_log_size=4, history_size=3) as (_, watcher, ctl):
        watcher.wait_generation(1)
        for flap in range(6):  # fail / recover the same GPU: one generation each
            fail_gpu(etcd, "rack0-n00", 2, {0} if flap % 2 == 0 else set(), seq=flap + 1)
            watcher.wait_generation(flap + 2)
        kvs, _ = etcd.get_prefix(keys.EVENTS)
        seqs = [codec.decode(types_pb2.Event, kv.value).seq for kv in kvs]
        assert seqs == list(range(4, 8))  # the newest 4 of 7 decisions
        history, _ = etcd.get_prefix(keys.job_plan_history("job1", 0)[:-12])
        assert [codec.decode(types_pb2.Plan, kv.value).generation for kv in history] == [5, 6, 7]
        assert [p.generation for p in watcher.plans] == list(range(1, 8))
