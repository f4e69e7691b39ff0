"""Membership in a real etcd: registration, health records, re-registration after an
outage, following the controller's desired caps."""

from __future__ import annotations

import threading

import grpc
import pytest
from tpflex_agent.desired import PowerAuthority
from tpflex_agent.membership import Membership
from tpflex_proto import agent_pb2, codec, keys, types_pb2
from tpflex_proto.etcd import Etcd

from tests.agent.conftest import running_agent
from tests.agent.support import wait_until


@pytest.fixture
def agent():
    with running_agent("m1", 4) as a:
        yield a


def health_watcher(etcd: Etcd, node: str, predicate):
    """A watch on health/<node>; the returned event is set once a record matches."""
    hit = threading.Event()
    records: list[types_pb2.NodeHealth] = []

    def on_events(events):
        for ev in events:
            if ev.kind == "put" and ev.key == keys.health(node):
                h = codec.decode(types_pb2.NodeHealth, ev.value, ev.key)
                records.append(h)
                if predicate(h):
                    hit.set()

    w = etcd.watch_prefix(keys.health(node), on_events)
    assert w.established.wait(5)
    return w, hit, records


def test_registration_and_xid79_reaches_etcd_as_failed_gpu(agent, etcd, etcd_server):
    client = Etcd(etcd_server.endpoints, timeout=1.0)
    m = Membership(client, agent.core, agent_address=f"127.0.0.1:{agent.port}", ttl_s=2).start()
    try:
        assert m.registered.wait(5)
        kv = etcd.get(keys.node("m1"))
        node = codec.decode(types_pb2.Node, kv.value, kv.key)
        assert (node.rack, node.backend, node.agent_address) == ("r1", "sim", f"127.0.0.1:{agent.port}")
        assert [g.index for g in node.gpus] == [0, 1, 2, 3] and kv.lease == m.lease_id != 0
        hkv = etcd.get(keys.health("m1"))
        assert hkv is not None and hkv.lease == m.lease_id
        w, hit, records = health_watcher(
            etcd, "m1", lambda h: h.gpus[2].state == types_pb2.GPU_FAILED and 79 in h.gpus[2].xids)
        try:
            agent.backend.inject_fault(2, "xid79")
            assert hit.wait(5), records
            failed = [h for h in records if h.gpus[2].state == types_pb2.GPU_FAILED][0]
            assert "xid 79" in failed.gpus[2].reason
            assert [g.state for g in failed.gpus[:2]] == [types_pb2.GPU_HEALTHY] * 2
            seqs = [h.seq for h in records]
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        finally:
            w.cancel()
    finally:
        m.stop()
        client.close()
    assert etcd.get(keys.node("m1")) is None  # revoked on stop, not left to expire


def test_reregisters_with_a_new_lease_after_an_etcd_outage(agent, etcd_server):
    client = Etcd(etcd_server.endpoints, timeout=0.5)
    m = Membership(client, agent.core, agent_address="x:1", ttl_s=1).start()
    try:
        assert m.registered.wait(5)
        old_lease = m.lease_id
        etcd_server.members[0].stop()
        wait_until(lambda: not m.registered.is_set(), 10, "the agent to give up its lease")
        agent.backend.inject_fault(0, "xid48")  # happens while etcd is down
        etcd_server.restart_member(0)
        assert m.registered.wait(15)
        reader = Etcd(etcd_server.endpoints)
        try:
            kv = reader.get(keys.node("m1"))
            assert kv is not None and kv.lease == m.lease_id != old_lease
            h = codec.decode(types_pb2.NodeHealth, reader.get(keys.health("m1")).value)
            assert h.gpus[0].state == types_pb2.GPU_FAILED  # the change made while down
        finally:
            reader.close()
    finally:
        m.stop()
        client.close()


def test_desired_caps_applied_at_start_followed_and_authoritative(agent, etcd):
    def put_plan(gen: int, caps: dict[int, float]) -> None:
        p = types_pb2.NodePowerPlan(node="m1", generation=gen)
        for i, w in caps.items():
            p.caps.add(gpu=types_pb2.GpuRef(node="m1", index=i), cap_w=w)
        etcd.put(keys.power("m1"), codec.encode(p))

    def limits() -> list[float]:
        return [agent.backend.read(i).power_limit_w for i in range(4)]

    put_plan(4, {1: 850.0})
    f = PowerAuthority(etcd, agent.core, check_s=0.2).start()
    agent.core.authority = f
    try:
        assert f.ready.wait(5)
        assert agent.core.power.applied_generation == 4 and limits()[1] == 850.0
        put_plan(5, {2: 880.0})
        wait_until(lambda: agent.core.power.applied_generation == 5, 5, "generation 5 applied")
        assert limits() == [700.0, 700.0, 880.0, 700.0]
        etcd.put(keys.power("m1"), b"\xff\x00garbage")  # skipped with a log line: 5 stays
        put_plan(3, {0: 300.0})  # older (etcd restored from a snapshot): etcd decides
        wait_until(lambda: limits() == [300.0, 700.0, 700.0, 700.0], 5, "generation 3 applied")
        assert agent.core.power.regressions >= 1
        # a push is applied only when it is etcd's desired state
        ok = agent_pb2.ApplyPowerPlanRequest(generation=3)
        ok.caps.add(gpu=types_pb2.GpuRef(node="m1", index=0), cap_w=300.0)
        assert agent.stub.ApplyPowerPlan(ok, timeout=5).outcome in (
            agent_pb2.ApplyPowerPlanResponse.ALREADY_APPLIED, agent_pb2.ApplyPowerPlanResponse.APPLIED)
        forged = agent_pb2.ApplyPowerPlanRequest(generation=2**64 - 1)
        forged.caps.add(gpu=types_pb2.GpuRef(node="m1", index=1), cap_w=900.0)
        with pytest.raises(grpc.RpcError) as err:
            agent.stub.ApplyPowerPlan(forged, timeout=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert limits() == [300.0, 700.0, 700.0, 700.0] and f.refused_pushes == 1
        etcd.delete(keys.power("m1"))  # no desired caps: every GPU at its default
        wait_until(lambda: limits() == [700.0] * 4, 5, "defaults")
    finally:
        f.stop()
        agent.core.authority = None
