"""The shared etcd client against a real etcd."""

from __future__ import annotations

import threading

import pytest

from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.etcd import Cmp, Etcd, EtcdUnavailable, Op


def test_put_get_prefix_delete(etcd):
    etcd.put("/t/a", b"1")
    etcd.put("/t/b", b"2")
    etcd.put("/u/c", b"3")
    kvs, rev = etcd.get_prefix("/t/")
    assert [(kv.key, kv.value) for kv in kvs] == [("/t/a", b"1"), ("/t/b", b"2")]
    assert rev >= 3
    assert etcd.get("/t/a").value == b"1"
    assert etcd.get("/nope") is None
    assert etcd.delete("/t/a") is True
    assert etcd.delete("/t/a") is False
    assert etcd.delete_prefix("/t/") == 1


def test_txn_compare_and_swap(etcd):
    create = etcd.txn([Cmp.create_revision("/k", "==", 0)], [Op.put("/k", b"v1")])
    assert create.succeeded
    again = etcd.txn([Cmp.create_revision("/k", "==", 0)], [Op.put("/k", b"v2")], [Op.get("/k")])
    assert not again.succeeded
    assert again.reads[0][0].value == b"v1"
    kv = etcd.get("/k")
    stale = etcd.txn([Cmp.mod_revision("/k", "==", kv.mod_revision - 1)], [Op.put("/k", b"x")])
    assert not stale.succeeded
    ok = etcd.txn([Cmp.mod_revision("/k", "==", kv.mod_revision)], [Op.put("/k", b"v3")])
    assert ok.succeeded and etcd.get("/k").value == b"v3"


def test_lease_expires_and_deletes_key(etcd):
    lease = etcd.grant_lease(1)
    etcd.put("/leased", b"x", lease=lease)
    assert etcd.keepalive_once(lease) > 0
    gone = threading.Event()

    def on_events(events):
        if any(e.kind == "delete" and e.key == "/leased" for e in events):
            gone.set()

    w = etcd.watch_prefix("/leased", on_events)
    try:
        assert gone.wait(5), "key bound to an unrefreshed 1 s lease was not deleted"
        assert etcd.keepalive_once(lease) == 0
    finally:
        w.cancel()


def test_watch_resumes_after_etcd_restart_without_losing_events(etcd_server):
    client = Etcd(etcd_server.endpoints, timeout=1.0)
    seen: list[str] = []
    cond = threading.Condition()

    def on_events(events):
        with cond:
            seen.extend(e.key for e in events)
            cond.notify_all()

    w = client.watch_prefix("/w/", on_events)
    try:
        assert w.established.wait(5)
        client.put("/w/1", b"a")
        with cond:
            assert cond.wait_for(lambda: "/w/1" in seen, 5)
        etcd_server.members[0].stop()
        with pytest.raises(EtcdUnavailable):
            client.put("/w/2", b"b")
        etcd_server.restart_member(0)
        writer = Etcd(etcd_server.endpoints)
        writer.put("/w/2", b"b")
        writer.put("/w/3", b"c")
        writer.close()
        with cond:
            assert cond.wait_for(lambda: "/w/3" in seen, 10)
        assert seen == ["/w/1", "/w/2", "/w/3"]
    finally:
        client.close()


def test_codec_rejects_garbage():
    rack = types_pb2.Rack(name="r1", domain_size=8, gpu_tdp_w=700)
    data = codec.encode(rack)
    assert codec.decode(types_pb2.Rack, data, keys.rack("r1")) == rack
    with pytest.raises(codec.MalformedValue, match="racks/r1"):
        codec.decode(types_pb2.Rack, b"\xff\xff\xff garbage", keys.rack("r1"))
    with pytest.raises(codec.MalformedValue):
        codec.decode(types_pb2.Rack, b'{"name": "json is not protobuf"}', keys.rack("r1"))


def test_three_member_cluster_survives_one_member_loss(etcd_cluster3):
    client = Etcd(etcd_cluster3.endpoints, timeout=2.0)
    try:
        client.put("/c/1", b"x")
        etcd_cluster3.members[0].kill()
        # the client fails over to a surviving member; the quorum of 2 keeps serving
        for _ in range(20):
            try:
                client.put("/c/2", b"y")
                break
            except EtcdUnavailable:
                continue
        assert client.get("/c/2").value == b"y"
    finally:
        client.close()


def test_client_replaces_its_channel_after_etcd_was_unreachable(etcd_server):
    """A gRPC channel that saw etcd go away can stay in reconnect backoff for ~10 s after
    etcd returns; the client swaps in a fresh channel instead, so the first call after
    the restart that etcd can serve succeeds."""
    client = Etcd(etcd_server.endpoints, timeout=1.0)
    try:
        client.put("/r/1", b"a")
        before = client._channel
        client._channel_born = 0.0  # past the rate limit on channel replacement
        etcd_server.members[0].stop()
        with pytest.raises(EtcdUnavailable):
            client.get("/r/1")
        assert client._channel is not before
        etcd_server.restart_member(0)
        client._channel_born = 0.0  # allow an immediate reset if the first call races
        for _ in range(50):
            try:
                assert client.get("/r/1").value == b"a"
                break
            except EtcdUnavailable:
                continue
        else:
            pytest.fail("etcd client did not reconnect")
    finally:
        client.close()
