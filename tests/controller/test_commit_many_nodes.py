"""Issue 14: a generation that changes the desired power of more nodes than one etcd
transaction may hold (a lagging controller folds many failures into one generation)
commits, under the test etcd's default --max-txn-ops (128), and so does the next one."""

from __future__ import annotations

from tpflex_controller import synthetic
from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.etcd import Op

from tests.controller.controller_harness import controller_on_job
from tests.support.wait import wait_until


def _health(etcd, failed: dict[str, set[int]], seq: int) -> None:
    """Every node's health in one transaction: the controller sees them in one batch."""
    etcd.txn([], [Op.put(keys.health(n), codec.encode(synthetic.failed_health(n, 4, f, seq)))
                  for n, f in failed.items()])


def _caps(etcd, node: str, rack) -> dict[int, float]:
    """The node's desired caps in etcd (TDP where no key was ever written)."""
    kv = etcd.get(keys.power(node))
    if kv is None:
        return {i: rack.gpu_tdp_w for i in range(rack.gpus_per_node)}
    return {c.gpu.index: c.cap_w for c in codec.decode(types_pb2.NodePowerPlan, kv.value).caps}


def _job_on_eight_racks(etcd_server, etcd):
    """8 racks of 18 nodes x 4 GPUs, job1 over them, a controller and a plan watcher."""
    return controller_on_job(etcd_server, etcd, shape=(8, 18, 4))


def test_one_generation_boosting_seven_racks_of_18_nodes_commits_and_the_next_too(etcd_server, etcd):
    with _job_on_eight_racks(etcd_server, etcd) as (racks, watcher, _ctl):
        full = watcher.wait_generation(1).replicas[0].tp_degree  # 64: the job's units
        # 7 racks lose 9 GPUs each (GPU 0 of 9 nodes): degree 63, boosted, so their 18
        # nodes each get new caps: 126 power keys in one generation
        _health(etcd, {n: {0} for r in racks[:7] for n in r.nodes[:9]}, seq=2)
        second = watcher.wait_generation(2)
        assert [r.tp_degree for r in second.replicas] == [full - 1] * 7 + [full]
        boosted = {(c.gpu.node, c.gpu.index): c.cap_w for c in second.power_caps}
        assert {n for n, _ in boosted} == {n for r in racks[:7] for n in r.nodes}
        for r in racks[:7]:
            for n in r.nodes:
                assert _caps(etcd, n, r) == {i: boosted.get((n, i), r.gpu_tdp_w) for i in range(4)}
        # back to healthy: every one of those power keys is compared and written again
        _health(etcd, {n: set() for r in racks[:7] for n in r.nodes[:9]}, seq=3)
        third = watcher.wait_generation(3)
        assert [r.tp_degree for r in third.replicas] == [full] * 8 and not third.power_caps
        assert all(set(_caps(etcd, n, r).values()) == {r.gpu_tdp_w} for r in racks for n in r.nodes)


def test_deleting_a_job_that_boosted_126_nodes_puts_them_all_back_to_tdp(etcd_server, etcd):
    with _job_on_eight_racks(etcd_server, etcd) as (racks, watcher, _ctl):
        watcher.wait_generation(1)
        _health(etcd, {n: {0} for r in racks[:7] for n in r.nodes[:9]}, seq=2)
        assert len({c.gpu.node for c in watcher.wait_generation(2).power_caps}) == 126
        etcd.delete(keys.job_spec("job1"))
        wait_until(lambda: etcd.get(keys.job_plan("job1")) is None, 10, "the deleted job's plan retired")
        assert all(set(_caps(etcd, n, r).values()) == {r.gpu_tdp_w} for r in racks for n in r.nodes)
