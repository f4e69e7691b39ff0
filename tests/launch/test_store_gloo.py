"""A real multi-process gloo job forms its process groups through the controller's
rendezvous store (real controller gRPC server, real etcd): init_process_group, a new
subgroup, collectives and a barrier, with no TCPStore anywhere."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import pytest
from tpflex_proto import keys

from tests.support import forkserver

_CTX = forkserver.context()
WORLD = 4


def _rank(rank: int, endpoint: str, job: str, results) -> None:
    try:
        import torch
        import torch.distributed as dist
        from tpflex_trainer.hooks.control import ControlConfig
        from tpflex_trainer.hooks.rendezvous import connect_store

        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        control = ControlConfig(endpoints=(endpoint,), job=job, rank=rank)
        store = connect_store("tpflex://", 60.0, control=control)  # what TPFLEX_STORE=tpflex:// gives
        dist.init_process_group("gloo", store=dist.PrefixStore("pg/", store), rank=rank,
                                world_size=WORLD, timeout=timedelta(seconds=60))
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        pair = dist.new_group([0, 1])  # every rank takes part in creating it
        u = torch.tensor([float(rank + 1)])
        if rank in (0, 1):
            dist.all_reduce(u, group=pair)
        gathered = [torch.zeros(1) for _ in range(WORLD)]
        dist.all_gather(gathered, torch.tensor([float(rank * 10)]))
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, "ok", (t.item(), u.item(), [g.item() for g in gathered])))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


@pytest.mark.slow
def test_gloo_process_groups_form_through_the_controller_store(served):
    job = served.new_job("gloo")
    results = _CTX.Queue()
    procs = [_CTX.Process(target=_rank, args=(r, served.endpoint, job, results), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        out = dict()
        for _ in range(WORLD):
            rank, status, value = results.get(timeout=120)
            assert status == "ok", f"rank {rank}:\n{value}"
            out[rank] = value
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    total = float(sum(range(1, WORLD + 1)))
    assert all(out[r][0] == total for r in range(WORLD))
    assert out[0][1] == out[1][1] == 3.0 and out[2][1] == 3.0 and out[3][1] == 4.0
    assert all(out[r][2] == [0.0, 10.0, 20.0, 30.0] for r in range(WORLD))
    # the rendezvous went through etcd, outside the cluster-state prefix the informers watch
    assert served.etcd.count_prefix(keys.rendezvous_keys(job)) >= WORLD
    assert served.etcd.count_prefix(keys.job_prefix(job)) == 1  # only the spec
