"""The controller's memory does not grow with the plan history (issue 14): on the shared
informer of a controller process (which keeps the leader key's value only), the reconcile
view and the plan feed hold the current plan's parts, not those of every kept generation,
and still hand out the very plans a reader of etcd assembles."""

from __future__ import annotations

from tpflex_controller.planfeed import PlanFeed
from tpflex_proto import keys, planstore
from tpflex_proto.informer import Informer
from tpflex_proto.keys import Kind

from tests.controller.controller_harness import (
    PlanWatcher,
    fail_gpu,
    put_job,
    small_cluster,
    start_controller,
)

GENERATIONS = 7


def test_view_and_feed_hold_the_current_parts_only(etcd_server, etcd):
    racks = small_cluster(etcd)
    put_job(etcd, racks)
    watcher = PlanWatcher(etcd, "job1")
    informer = Informer(etcd, keep=frozenset({Kind.LEADER}))  # as main.py builds it
    feed = PlanFeed(etcd, informer)  # registered before the start, as in main.py
    ctl = start_controller(etcd_server.endpoints, informer=informer)
    informer.start()
    try:
        watcher.wait_generation(1, timeout=20)
        # one GPU of rack0 fails and recovers: each generation rewrites replica 0's part
        for gen in range(2, GENERATIONS + 1):
            fail_gpu(etcd, "rack0-n00", 2, {1} if gen % 2 == 0 else set(), seq=gen)
            watcher.wait_generation(gen, timeout=20)
        sub = feed.subscribe("job1")  # a late subscription starts from the kept keys
        fail_gpu(etcd, "rack1-n00", 2, {0}, seq=GENERATIONS + 1)  # replica 1 changes only
        last = watcher.wait_generation(GENERATIONS + 1, timeout=20)
        offered = sub.get(timeout=10)
        assert offered is not None and offered.generation == GENERATIONS + 1
        # the same bytes as a reader of etcd assembles (replica 0's part from an earlier
        # generation, kept by the feed since then)
        assert offered.SerializeToString(deterministic=True) == last.SerializeToString(deterministic=True)
        assert offered == planstore.read_plan(etcd, "job1")

        kvs, _ = etcd.get_prefix(keys.job_assigns("job1"))
        assert len(kvs) > GENERATIONS  # etcd keeps every kept generation's parts
        positions = len(last.replicas)
        assert informer.wait_revision(etcd.get(keys.job_plan("job1")).mod_revision, 10)
        view_index = ctl.reconciler.view.plan_parts["job1"]
        assert sum(len(g) for g in view_index.gens.values()) == len(kvs)  # all indexed
        assert len(view_index.values) == positions  # values: the current plan's only
        feed_index = feed._current["job1"][1]
        assert len(feed_index.values) == positions
        assert [c.key for c in informer.items()] == [keys.LEADER]
    finally:
        ctl.stop()
        informer.stop()
        watcher.close()


def test_per_node_state_leaves_with_the_node():
    """ClusterView keeps no per-node entry for a healthy node's GPU set, nor a revision for
    the keys of a node that is gone (a fleet that replaces nodes must not grow the view);
    the keys it writes itself still keep theirs (a late echo must not move it back)."""
    from tpflex_controller import synthetic
    from tpflex_controller.cache import ClusterView
    from tpflex_proto import codec, types_pb2

    view = ClusterView()
    rack = synthetic.rack("r0", 2, 2)
    view.fold("put", keys.rack("r0"), codec.encode(rack), 2)
    node = rack.nodes[0]
    view.fold("put", keys.node(node), codec.encode(types_pb2.Node(name=node)), 3)
    failed = synthetic.failed_health(node, 2, {1})
    view.fold("put", keys.health(node), codec.encode(failed), 4)
    assert view._node_health_keys == {node: {(node, 1)}}
    view.fold("put", keys.health(node), codec.encode(synthetic.failed_health(node, 2, set())), 5)
    assert view._node_health_keys == {}  # healthy: no entry
    view.fold("put", keys.health(node), codec.encode(failed), 6)
    view.fold("delete", keys.health(node), b"", 7)
    view.fold("delete", keys.node(node), b"", 8)
    assert view._node_health_keys == {}
    assert keys.node(node) not in view._key_revs and keys.health(node) not in view._key_revs
    # a power key (this process writes them): its revision stays after a delete
    power = types_pb2.NodePowerPlan(node=node, generation=1)
    view.fold("put", keys.power(node), codec.encode(power), 9)
    view.fold("delete", keys.power(node), b"", 10)
    assert view._key_revs[keys.power(node)] == 10
    view.fold("put", keys.power(node), codec.encode(power), 9)  # older: ignored
    assert node not in view.power


def test_a_deleted_racks_gauge_goes_with_it(etcd_server, etcd):
    """tpflex_rack_healthy_gpus{rack}: a rack's series leaves the registry with the rack."""
    from tests.controller.controller_harness import eventually

    racks = small_cluster(etcd, racks=3)
    put_job(etcd, racks[:2])
    ctl = start_controller(etcd_server.endpoints)
    try:
        def gauge(rack):
            return ctl.registry.get_sample_value("tpflex_rack_healthy_gpus", {"rack": rack})

        eventually(lambda: gauge("rack2") == 4.0)
        etcd.delete(keys.rack("rack2"))
        fail_gpu(etcd, "rack0-n00", 2, {1})  # a later change: the deletion was folded
        eventually(lambda: gauge("rack0") == 3.0)
        assert gauge("rack2") is None and gauge("rack1") == 4.0
    finally:
        ctl.stop()


def _malloc_used_mb() -> float:
    from tpflex_controller import memtrace

    return float(dict(kv.split("=") for kv in memtrace.malloc_stats().split())["malloc_used_mb"])


def test_a_nodes_power_plan_is_kept_compact_by_the_view_and_the_pusher():
    """5,000 nodes' power plans folded into the view (as the watch brings them) and pending
    in the pusher (agents not known yet: kept until they register): what both hold grows
    glibc's heap by under 2 MB (0.5 here: the two dicts), the caps and generations as
    folded. Before, each held a decoded NodePowerPlan per node (~1.1 KB of upb arena
    each: 11.2 MB here), made as failures first touched each rack: the controller grew
    with them."""
    import pytest
    from tpflex_controller import heap
    from tpflex_controller.agent_client import AgentPusher
    from tpflex_controller.cache import ClusterView, NodePower
    from tpflex_proto import codec, types_pb2

    if heap._glibc() is None:
        pytest.skip("glibc's account of its heap")
    nodes = [f"r{n // 18:04d}-n{n % 18:02d}" for n in range(5000)]
    wire = {n: codec.encode(types_pb2.NodePowerPlan(node=n, generation=3, caps=[
        types_pb2.PowerCap(gpu=types_pb2.GpuRef(node=n, index=i), cap_w=600.0 + i) for i in range(4)]))
        for n in nodes}
    view = ClusterView()
    pusher = AgentPusher(lambda r: None)
    try:
        before = _malloc_used_mb()
        for rev, n in enumerate(nodes, start=10):
            view.fold("put", keys.power(n), wire[n], rev)
            pusher.push(n, "", NodePower.of(codec.decode(types_pb2.NodePowerPlan, wire[n])))
        grown = _malloc_used_mb() - before
        assert view.power[nodes[7]] == (NodePower(3, ((0, 600.0), (1, 601.0), (2, 602.0), (3, 603.0))), 17)
        assert pusher.pending() == dict.fromkeys(nodes, 3)
        assert grown < 2, grown
    finally:
        pusher.close()
