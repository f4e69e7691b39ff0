"""The load benchmark's nodes: leases renewed from their own process, and a node whose
lease is gone counted as lost by the invariant oracle and the decision checker (issue 14)."""

from __future__ import annotations

import time

from tpflex_controller import convert, synthetic
from tpflex_proto import keys

from bench.lease_keeper import LeaseKeeper, RenewalSchedule
from bench.load import DecisionChecker, NodeFleet, NodeLog
from bench.load_oracle import InvariantOracle
from tests.support.wait import wait_until


def test_schedule_renews_oldest_first_never_twice_in_flight_and_tracks_the_worst_gap():
    s = RenewalSchedule({1: 0.0, 2: 1.0, 3: 2.0}, period_s=10.0)
    assert s.next_due(9.9) is None and s.wait_s(9.9) > 0  # nothing due before its period
    assert [s.next_due(12.5), s.next_due(12.5), s.next_due(12.5)] == [1, 2, 3]
    assert s.next_due(100.0) is None  # all three in flight: none is sent twice
    s.answered(2, 60, 13.0)
    s.answered(1, 60, 15.0)  # lease 1: 15 s since its grant, the worst so far
    s.answered(3, 0, 15.5)  # lease 3 was gone: counted, never renewed again
    assert (s.acks, s.expiries, s.expired, s.lag_max_s) == (2, 1, {3}, 15.0)
    assert s.next_due(22.9) is None and s.next_due(23.0) == 2 and s.next_due(25.0) == 1
    s.requeue([1])  # its stream broke: due again at once, 2 stays in flight
    assert s.in_flight == {2} and s.next_due(25.0) == 1 and s.next_due(1e9) is None
    assert s.worst_lag_s(40.0) == 27.0  # lease 2's open gap since its ack at 13.0


def test_keeper_process_keeps_leases_alive_past_their_ttl(etcd, etcd_server):
    ttl = 2
    granted = {}
    for i in range(3):
        lease = etcd.grant_lease(ttl)
        granted[lease] = time.time()
        etcd.put(f"/bench/node{i}", b"x", lease=lease)
    keeper = LeaseKeeper(etcd_server.endpoints, granted, ttl, streams=2, window=2)
    try:
        start = time.monotonic()
        # three TTLs later every key bound to a lease is still there
        wait_until(lambda: time.monotonic() - start > 3 * ttl, 30, "three TTLs", interval=0.2)
        assert etcd.count_prefix("/bench/node") == 3
    finally:
        figures = keeper.stop()
    assert figures["leases_expired"] == 0 and figures["lease_keepalives"] >= 3 * 3
    assert 0 < figures["lease_renew_lag_max_s"] < ttl


def _small():
    racks = [synthetic.rack(f"r{i}", 2, 2) for i in range(2)]
    return racks, {"j": synthetic.job("j", [r.name for r in racks], 4)}


def test_oracle_counts_a_node_whose_lease_is_revoked_as_lost(etcd):
    racks, jobs = _small()
    nodes = [n for r in racks for n in r.nodes]
    checker = DecisionChecker(racks, jobs, nodes)
    oracle = InvariantOracle(racks, jobs)
    fleet = NodeFleet(etcd, racks)
    fleet.register()
    nodelog = NodeLog(etcd, fleet.lost)
    try:
        before = etcd.put("/bench/mark", b"")
        etcd.revoke_lease(fleet.leases["r0-n00"])  # what a lapse does: the node's keys go
        wait_until(lambda: "r0-n00" in nodelog.gone, 10, "the node's deletion seen")
        after = etcd.put("/bench/mark", b"")
    finally:
        nodelog.close()
    losses = nodelog.losses()
    assert [n for _, n in losses] == ["r0-n00"] and before < losses[0][0] < after
    assert "r0-n00" in fleet.lost and etcd.get(keys.node("r0-n01")) is not None
    healthy = convert.plan_to_proto(checker.expected("j", {}), 1)
    without = convert.plan_to_proto(checker.expected("j", {"r0-n00": frozenset({0, 1})}), 2)
    plans = [(before, 0.0, healthy), (after, 0.0, without)]
    # the controller dropped the lost node's GPUs: right, given the loss
    assert oracle.check("j", plans, [], losses) == []
    assert checker.check("j", plans, [], losses) == (2, 0) and checker.check_final("j", plans, [], losses)
    # an oracle blind to the loss (the old one) blames the controller for it
    assert any("usable GPUs 4" in v for v in oracle.check("j", plans, []))
    assert checker.check("j", plans, []) == (2, 1)
    # and a plan after the loss that still uses the lost node's GPUs is a violation
    again = convert.plan_to_proto(checker.expected("j", {}), 3)
    found = oracle.check("j", [*plans, (after + 1, 0.0, again)], [], losses)
    assert any("r0-n00" in v for v in found)
    assert checker.check("j", [*plans, (after + 1, 0.0, again)], [], losses) == (3, 1)
