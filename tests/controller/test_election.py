"""Leader election and fenced leader writes against a real etcd."""

from __future__ import annotations

import threading
import time

import pytest
from tpflex_controller.election import Conflict, Elector, LeaderSession, NotLeader
from tpflex_controller.planning import PlanCommit, commit_plan
from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.etcd import Cmp, Op


def _campaign(etcd, identity: str, ttl: int = 1) -> LeaderSession:
    lease = etcd.grant_lease(ttl)
    rec = types_pb2.LeaderRecord(id=identity)
    res = etcd.txn(
        [Cmp.create_revision(keys.LEADER, "==", 0)],
        [Op.put(keys.LEADER, codec.encode(rec), lease=lease)],
    )
    assert res.succeeded
    return LeaderSession(etcd, rec, lease, res.revision)


class _Elected:
    def __init__(self) -> None:
        self.sessions: list[LeaderSession] = []
        self.deposed: list[str] = []
        self.event = threading.Event()

    def on_elected(self, s: LeaderSession) -> None:
        self.sessions.append(s)
        self.event.set()

    def on_deposed(self, why: str) -> None:
        self.deposed.append(why)


def test_deposed_leader_write_is_refused_by_the_fence(etcd):
    old = _campaign(etcd, "old")
    old.put("/tpflex/v1/probe", b"old-1")
    etcd.revoke_lease(old.lease_id)  # the old leader's lease lapses (e.g. a long GC pause)
    new = _campaign(etcd, "new")
    new.put("/tpflex/v1/probe", b"new-1")

    with pytest.raises(NotLeader):
        old.put("/tpflex/v1/probe", b"old-2")
    assert etcd.get("/tpflex/v1/probe").value == b"new-1"
    assert not old.active
    with pytest.raises(NotLeader):  # and it stays stepped down
        old.put("/tpflex/v1/probe", b"old-3")


def test_plan_commit_is_compare_and_swap_on_the_plan_key(etcd):
    s = _campaign(etcd, "leader", ttl=5)
    first = PlanCommit("j", 1, b"plan-1", 0, parts={0: b"p0", 1: b"p1"}, event_seq=1, event_bytes=b"e1")
    rev = commit_plan(s, first)
    assert etcd.get(keys.job_plan("j")).mod_revision == rev
    assert etcd.get(keys.job_assign("j", 1, 1)).value == b"p1"
    stale = PlanCommit("j", 2, b"plan-2", 0, parts={1: b"x"}, event_seq=2, event_bytes=b"e2")
    with pytest.raises(Conflict):
        commit_plan(s, stale)  # based on "no plan yet", but generation 1 exists
    assert etcd.get(keys.job_plan("j")).value == b"plan-1"
    assert etcd.get(keys.job_plan_history("j", 2)) is None
    assert etcd.get(keys.job_assign("j", 2, 1)) is None
    assert etcd.get(keys.event(2)) is None
    ok = PlanCommit(
        "j", 2, b"plan-2", rev, parts={1: b"p1'"}, power={"n1": (b"caps", 0)}, event_seq=2,
        event_bytes=b"e2", trim_event_seq=1, trim_history_generation=1, trim_parts=[(1, 1)],
    )
    commit_plan(s, ok)
    assert etcd.get(keys.job_plan_history("j", 2)).value == b"plan-2"
    assert etcd.get(keys.job_plan_history("j", 1)) is None  # trimmed in the same txn
    assert etcd.get(keys.job_assign("j", 1, 1)) is None and etcd.get(keys.job_assign("j", 1, 0)).value == b"p0"
    assert etcd.get(keys.job_assign("j", 2, 1)).value == b"p1'"
    assert etcd.get(keys.event(1)) is None and etcd.get(keys.event(2)).value == b"e2"
    assert etcd.get(keys.power("n1")).value == b"caps"


def test_two_electors_one_leads_and_a_resign_hands_over(etcd_server, etcd):
    a_cb, b_cb = _Elected(), _Elected()
    a = Elector(etcd, "a", ttl=2, on_elected=a_cb.on_elected, on_deposed=a_cb.on_deposed)
    a.start()
    try:
        assert a_cb.event.wait(5)
        b = Elector(etcd, "b", ttl=2, on_elected=b_cb.on_elected, on_deposed=b_cb.on_deposed)
        b.start()
        try:
            assert not b_cb.event.wait(1.0)  # a stays leader while it keeps its lease alive
            assert a.is_leader and not b.is_leader
            t0 = time.monotonic()
            a.stop(resign=True)
            assert b_cb.event.wait(3), "standby did not take over after the leader resigned"
            assert time.monotonic() - t0 < 1.0  # resignation frees the key at once (TTL is 2 s)
            assert b.is_leader and not a.is_leader
            rec = codec.decode(types_pb2.LeaderRecord, etcd.get(keys.LEADER).value)
            assert rec.id == "b"
            with pytest.raises(NotLeader):
                a_cb.sessions[0].put("/tpflex/v1/probe", b"x")
        finally:
            b.stop()
    finally:
        a.stop()


def test_leader_steps_down_when_its_lease_is_revoked(etcd):
    cb = _Elected()
    e = Elector(etcd, "solo", ttl=2, on_elected=cb.on_elected, on_deposed=cb.on_deposed)
    e.start()
    try:
        assert cb.event.wait(5)
        first = cb.sessions[0]
        cb.event.clear()
        etcd.revoke_lease(first.lease_id)
        assert cb.event.wait(5), "did not campaign again after losing the lease"
        assert cb.deposed and not first.active
        assert cb.sessions[1].create_revision > first.create_revision
    finally:
        e.stop()


def test_an_elector_on_the_shared_informer_is_deposed_when_its_key_is_deleted(etcd):
    """The controller's elector takes the leader key's changes from the process's informer:
    a deleted key deposes the leader at once (its lease is still alive, so nothing else
    would tell it) and it campaigns again."""
    from tpflex_proto.informer import Informer

    informer = Informer(etcd).start()
    cb = _Elected()
    e = Elector(etcd, "a", ttl=30, on_elected=cb.on_elected, on_deposed=cb.on_deposed, informer=informer)
    e.start()
    try:
        assert cb.event.wait(5)
        first = cb.sessions[0]
        assert informer.wait_revision(first.create_revision, 5)
        cb.event.clear()
        etcd.delete(keys.LEADER)
        assert cb.event.wait(10), "not deposed and elected again after the key was deleted"
        assert not first.active and cb.deposed == ["lease lost"]
        assert cb.sessions[1].create_revision > first.create_revision and e.leader_id == "a"
    finally:
        e.stop()
        informer.stop()
