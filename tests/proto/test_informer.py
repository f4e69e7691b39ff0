"""The shared informer against a real etcd: initial list, puts and deletes decoded once,
a late handler gets the current state first, a compacted history is re-listed and only
its differences delivered, and a raising handler does not stop the others."""

from __future__ import annotations

import logging
import queue

import pytest
from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.etcd import Etcd
from tpflex_proto.informer import Batch, Informer, Op, decode_change, diff

from tests.reliability.proxy import CuttableProxy
from tests.support.wait import wait_until


class Recorder:
    def __init__(self) -> None:
        self.batches: queue.SimpleQueue[Batch] = queue.SimpleQueue()

    def __call__(self, batch: Batch) -> None:
        self.batches.put(batch)

    def next(self, timeout: float = 10.0) -> Batch:
        return self.batches.get(timeout=timeout)

    def until(self, pred, timeout: float = 10.0) -> list[Batch]:
        """Batches up to and including the first one for which ``pred`` holds."""
        seen = []
        while True:
            b = self.next(timeout)
            seen.append(b)
            if pred(b):
                return seen


def _rack(name: str, nodes: int = 2) -> bytes:
    return codec.encode(types_pb2.Rack(
        name=name, nodes=[f"{name}-n{i}" for i in range(nodes)], gpus_per_node=4))


def _health(node: str, failed: int) -> bytes:
    return codec.encode(types_pb2.NodeHealth(node=node, gpus=[
        types_pb2.GpuHealth(index=failed, state=types_pb2.GPU_FAILED)]))


@pytest.fixture
def informer(etcd):
    inf = Informer(etcd, retry_s=0.05)
    try:
        yield inf
    finally:
        inf.stop()


def test_initial_list_then_puts_and_deletes_decoded_once(etcd, informer):
    etcd.put(keys.rack("r1"), _rack("r1"))
    etcd.put(keys.job_plan("j"), b"\x08\x01")  # plan headers stay bytes
    rec = Recorder()
    informer.add_handler(rec)  # before start: the first list is its initial batch
    informer.start()
    first = rec.next()
    assert first.initial and not first.resync
    assert [c.key for c in first.changes] == [keys.job_plan("j"), keys.rack("r1")]
    rack = first.changes[1]
    assert rack.op is Op.PUT and rack.parsed == keys.Key(keys.Kind.RACK, "r1")
    assert isinstance(rack.msg, types_pb2.Rack) and list(rack.msg.nodes) == ["r1-n0", "r1-n1"]
    assert first.changes[0].msg is None and first.changes[0].value == b"\x08\x01"

    rev = etcd.put(keys.health("r1-n0"), _health("r1-n0", 3))
    etcd.delete(keys.rack("r1"))
    got = [c for b in rec.until(lambda b: any(c.deleted for c in b.changes)) for c in b.changes]
    assert [(c.op, c.key) for c in got] == [(Op.PUT, keys.health("r1-n0")), (Op.DELETE, keys.rack("r1"))]
    assert got[0].mod_revision == rev and got[0].msg.gpus[0].state == types_pb2.GPU_FAILED
    assert informer.get(keys.rack("r1")) is None
    assert informer.get(keys.health("r1-n0")).msg.node == "r1-n0"
    assert informer.wait_revision(rev + 1, timeout=5) and informer.revision == rev + 1


def test_malformed_value_is_flagged_not_raised(etcd, informer, caplog):
    informer.start()
    rec = Recorder()
    informer.add_handler(rec)
    assert rec.next().initial
    with caplog.at_level(logging.WARNING):
        etcd.put(keys.rack("bad"), b"\xff\xff\xff")
        etcd.put(keys.rack("good"), _rack("good"))
        changes = [c for b in rec.until(lambda b: b.changes[-1].key == keys.rack("good")) for c in b.changes]
    bad, good = changes
    assert bad.malformed and bad.msg is None and not good.malformed and good.msg.name == "good"
    assert "skipping malformed etcd value key=/tpflex/v1/racks/bad" in caplog.text


def test_late_handler_gets_current_state_first_then_changes(etcd, informer):
    informer.start()
    early = Recorder()
    informer.add_handler(early)
    early.next()
    etcd.put(keys.rack("r1"), _rack("r1"))
    rev = etcd.put(keys.rack("r2"), _rack("r2"))
    assert informer.wait_revision(rev, timeout=10)
    late = Recorder()
    informer.add_handler(late)
    first = late.next()
    assert first.initial and first.revision == rev
    assert [c.key for c in first.changes] == [keys.rack("r1"), keys.rack("r2")]
    etcd.delete(keys.rack("r1"))
    after = late.next()
    assert not after.initial and [(c.op, c.key) for c in after.changes] == [(Op.DELETE, keys.rack("r1"))]


def test_raising_handler_is_logged_and_others_still_get_every_batch(etcd, informer, caplog):
    informer.start()

    def broken(batch: Batch) -> None:
        raise RuntimeError("handler bug")

    rec = Recorder()
    with caplog.at_level(logging.ERROR):
        informer.add_handler(broken)
        informer.add_handler(rec)
        assert rec.next().initial
        etcd.put(keys.rack("r1"), _rack("r1"))
        etcd.put(keys.rack("r2"), _rack("r2"))
        keys_seen = [c.key for b in rec.until(lambda b: b.changes[-1].key == keys.rack("r2")) for c in b.changes]
    assert keys_seen == [keys.rack("r1"), keys.rack("r2")]
    assert caplog.text.count("informer handler failed") >= 2  # initial batch and the puts
    assert "handler bug" in caplog.text


def test_unregistered_handler_gets_nothing_more(etcd, informer):
    informer.start()
    rec, other = Recorder(), Recorder()
    unregister = informer.add_handler(rec)
    informer.add_handler(other)
    rec.next(), other.next()
    unregister()
    etcd.put(keys.rack("r1"), _rack("r1"))
    assert other.next().changes[0].key == keys.rack("r1")
    assert rec.batches.empty()


def test_compaction_under_a_stopped_watch_relists_and_delivers_the_differences(etcd_server, etcd):
    etcd.put(keys.rack("kept"), _rack("kept"))
    etcd.put(keys.rack("changed"), _rack("changed", 1))
    etcd.put(keys.rack("gone"), _rack("gone"))
    proxy = CuttableProxy(etcd_server.endpoints[0])
    client = Etcd([proxy.endpoint], timeout=1.0)
    inf = Informer(client, retry_s=0.05)
    rec = Recorder()
    inf.add_handler(rec)
    try:
        inf.start()
        assert rec.next().initial
        wait_until(lambda: inf.connected, 10, "informer watching")
        proxy.cut()  # the informer's watch stops
        wait_until(lambda: not inf.connected, 10, "informer disconnected")
        etcd.put(keys.rack("changed"), _rack("changed", 3))
        etcd.delete(keys.rack("gone"))
        etcd.put(keys.rack("new"), _rack("new"))
        for i in range(5):
            etcd.put(keys.rack("churn"), _rack("churn", i + 1))
        etcd.delete(keys.rack("churn"))  # created and deleted while away: no change at all
        rev = etcd.put(keys.rack("new"), _rack("new", 2))
        etcd.compact(rev)
        proxy.heal()
        resync = rec.until(lambda b: b.resync, timeout=20)[-1]
        got = {(c.op, c.key) for c in resync.changes}
        assert got == {(Op.PUT, keys.rack("changed")), (Op.DELETE, keys.rack("gone")),
                       (Op.PUT, keys.rack("new"))}
        assert resync.revision >= rev
        by_key = {c.key: c for c in resync.changes}
        assert len(by_key[keys.rack("changed")].msg.nodes) == 3
        assert len(by_key[keys.rack("new")].msg.nodes) == 2
        # and it watches on from the re-listed revision
        after = etcd.put(keys.rack("later"), _rack("later"))
        b = rec.until(lambda b: any(c.key == keys.rack("later") for c in b.changes))[-1]
        assert b.changes[-1].mod_revision == after and not b.resync
        assert sorted(c.key for c in inf.items(keys.RACKS)) == [
            keys.rack(n) for n in ("changed", "kept", "later", "new")]
    finally:
        inf.stop()
        client.close()
        proxy.close()


def test_diff_is_exact():
    held = {"/tpflex/v1/racks/a": 5, "/tpflex/v1/racks/b": 6, "/tpflex/v1/racks/d": 7}
    from tpflex_proto.etcd import KeyValue

    listed = [KeyValue("/tpflex/v1/racks/a", _rack("a"), 0, 5, 0, 0),
              KeyValue("/tpflex/v1/racks/c", _rack("c"), 0, 9, 0, 0),
              KeyValue("/tpflex/v1/racks/d", _rack("d", 3), 0, 8, 0, 0)]
    out = diff(held, listed, 10)
    assert [(c.op, c.key, c.mod_revision) for c in out] == [
        (Op.PUT, "/tpflex/v1/racks/c", 9), (Op.PUT, "/tpflex/v1/racks/d", 8),
        (Op.DELETE, "/tpflex/v1/racks/b", 10)]
    assert out[2].parsed == keys.Key(keys.Kind.RACK, "b") and len(out[1].msg.nodes) == 3


def test_kept_kinds_only_hold_values_yet_every_change_is_delivered(etcd_server, etcd):
    """``keep``: after the first sync the informer holds items of the kept kinds only (the
    others: their revisions, so a re-list after a compaction still finds their exact
    differences); handlers registered before the start get the whole listed state, and
    every change of every kind."""
    etcd.put(keys.rack("r1"), _rack("r1"))
    etcd.put(keys.job_plan_history("j", 1), b"\x08\x01")
    proxy = CuttableProxy(etcd_server.endpoints[0])
    client = Etcd([proxy.endpoint], timeout=1.0)
    inf = Informer(client, retry_s=0.05, keep=frozenset({keys.Kind.LEADER}))
    rec = Recorder()
    inf.add_handler(rec)
    try:
        inf.start()
        first = rec.next()
        assert first.initial and [c.key for c in first.changes] == [
            keys.job_plan_history("j", 1), keys.rack("r1")]
        etcd.put(keys.LEADER, codec.encode(types_pb2.LeaderRecord(id="c1")))
        rev = etcd.put(keys.job_plan_history("j", 2), b"\x08\x02")
        got = [c.key for b in rec.until(lambda b: b.changes[-1].mod_revision == rev) for c in b.changes]
        assert got == [keys.LEADER, keys.job_plan_history("j", 2)]
        assert inf.get(keys.rack("r1")) is None and inf.get(keys.job_plan_history("j", 2)) is None
        assert [c.key for c in inf.items()] == [keys.LEADER]
        late = Recorder()
        inf.add_handler(late)
        assert [c.key for c in late.next().changes] == [keys.LEADER]

        wait_until(lambda: inf.connected, 10, "informer watching")
        proxy.cut()
        wait_until(lambda: not inf.connected, 10, "informer disconnected")
        etcd.delete(keys.job_plan_history("j", 1))
        etcd.put(keys.rack("r2"), _rack("r2"))
        last = etcd.put(keys.rack("r1"), _rack("r1", 3))
        etcd.compact(last)
        proxy.heal()
        resync = rec.until(lambda b: b.resync, timeout=20)[-1]
        assert {(c.op, c.key) for c in resync.changes} == {
            (Op.DELETE, keys.job_plan_history("j", 1)), (Op.PUT, keys.rack("r2")), (Op.PUT, keys.rack("r1"))}
        assert [c.key for c in inf.items()] == [keys.LEADER]
    finally:
        inf.stop()
        client.close()
        proxy.close()


def test_a_value_is_decoded_on_the_first_look_only(caplog):
    """A change no handler reads is never decoded (no log line for a malformed one either);
    the first look decodes it, the next ones get the same message."""
    value = _rack("r7")
    change = decode_change(Op.PUT, keys.rack("r7"), value, 5)
    assert change._msg is not None and not isinstance(change._msg, types_pb2.Rack)  # not decoded yet
    first = change.msg
    assert first == codec.decode(types_pb2.Rack, value, keys.rack("r7")) and change.msg is first
    assert not change.malformed
    with caplog.at_level(logging.WARNING):
        bad = decode_change(Op.PUT, keys.rack("bad"), b"\xff\xff\xff", 6)
        assert "skipping malformed" not in caplog.text
        assert bad.malformed and bad.msg is None
    assert caplog.text.count("skipping malformed etcd value key=/tpflex/v1/racks/bad") == 1
