"""The reconcile loop against a real etcd: health changes become plan generations."""

from __future__ import annotations

from tpflex_proto import codec, keys, types_pb2

from tests.controller.controller_harness import (
    controller_on_job,
    fail_gpu,
)


def _events(etcd) -> list[types_pb2.Event]:
    kvs, _ = etcd.get_prefix(keys.EVENTS)
    return [codec.decode(types_pb2.Event, kv.value, kv.key) for kv in kvs]


def test_failed_gpu_gets_new_generation_and_recovery_restores(etcd_server, etcd):
    with controller_on_job(etcd_server, etcd) as (racks, watcher, ctl):
        first = watcher.wait_generation(1)
        assert [r.tp_degree for r in first.replicas] == [4, 4]
        assert first.expected_throughput_ratio == 1.0

        fail_gpu(etcd, "rack1-n00", 2, {1})
        second = watcher.wait_generation(2)
        assert second.cause == "gpu_failed"
        assert [r.tp_degree for r in second.replicas] == [4, 3]
        used = [(g.node, g.index) for s in second.replicas[1].stages for g in s.gpus]
        assert ("rack1-n00", 1) not in used
        # the degraded rack is boosted; its desired caps are stored per node
        boosted = {(c.gpu.node, c.gpu.index): c.cap_w for c in second.power_caps}
        assert boosted and all(node.startswith("rack1-") for node, _ in boosted)
        power = codec.decode(types_pb2.NodePowerPlan, etcd.get(keys.power("rack1-n01")).value)
        assert {c.gpu.index: c.cap_w for c in power.caps} == {
            i: boosted[("rack1-n01", i)] for i in range(2)
        }

        fail_gpu(etcd, "rack1-n00", 2, set(), seq=2)
        third = watcher.wait_generation(3)
        assert third.cause == "gpu_recovered"
        assert [r.tp_degree for r in third.replicas] == [4, 4]
        assert not third.power_caps
        power = codec.decode(types_pb2.NodePowerPlan, etcd.get(keys.power("rack1-n01")).value)
        assert {c.cap_w for c in power.caps} == {racks[1].gpu_tdp_w}

        history, _ = etcd.get_prefix(keys.job_plan_history("job1", 0)[:-12])
        assert [codec.decode(types_pb2.Plan, kv.value).generation for kv in history] == [1, 2, 3]
        committed = [e for e in _events(etcd) if e.kind == "plan_committed"]
        assert [(e.generation, e.cause) for e in committed][-2:] == [(2, "gpu_failed"), (3, "gpu_recovered")]
        assert {"detected", "committed"} <= {p.phase for p in committed[-1].phases}


def test_a_decisions_event_is_written_with_the_commit_and_names_only_what_changed(etcd_server, etcd):
    """The commit stores the event with its detected and committed phases; the loop does
    not write it again for "committed" alone (no agent here: power is never applied), and
    the event lists the reasons the decision added or resolved, not the whole plan's."""
    with controller_on_job(etcd_server, etcd) as (_racks, watcher, _ctl):
        watcher.wait_generation(1)
        fail_gpu(etcd, "rack1-n00", 2, {1})
        second = watcher.wait_generation(2)
        fail_gpu(etcd, "rack1-n00", 2, set(), seq=2)
        third = watcher.wait_generation(3)
        kvs, _ = etcd.get_prefix(keys.EVENTS)
        by_gen = {}
        for kv in kvs:
            e = codec.decode(types_pb2.Event, kv.value, kv.key)
            if e.kind == "plan_committed":
                by_gen[e.generation] = (e, kv)
        event2, kv2 = by_gen[2]
        assert kv2.version == 1, "the event of generation 2 was rewritten with no new phase"
        assert {p.phase for p in event2.phases} == {"detected", "committed"}
        assert list(event2.reasons) == list(second.reasons) and second.reasons
        assert not third.reasons
        assert list(by_gen[3][0].reasons) == [f"resolved: {r}" for r in second.reasons]
