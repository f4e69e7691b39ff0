"""The small-tensor exchange behind ``all_reduce`` on gloo (``ntp.collectives``), with real
gloo processes: it waits only for what it receives (a send can be left waiting by gloo
after its peer's connection broke), sends a copy, and waits for its sends at the next
exchange with the same peer, so none pile up."""

from __future__ import annotations

from tests.trainer.harness import run_workers


def _exchange_without_waiting_for_the_send(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist
    from tpflex_trainer.ntp import collectives

    store = dist.distributed_c10d._get_default_store()
    group = dist.new_group([0, 1])
    if rank == 0:
        mine = torch.tensor([1.0, 2.0])
        # rank 1 has sent its part but posts its receive only after this returns: waiting
        # for our send to complete would wait for rank 1, which waits for us
        parts = collectives.Exchange(mine, group).wait()
        got = [p.tolist() for p in parts]
        mine.fill_(-5.0)  # changed before rank 1 receives it: rank 1 must get what was sent
        store.set("rank0-returned", b"1")
        second = collectives.all_reduce(torch.tensor([10.0, 20.0]), group)
        return {"parts": got, "second": second.tolist(),
                "unreaped": {peer: len(sends) for peer, sends in collectives._UNREAPED[group].items()}}
    theirs = torch.tensor([3.0, 4.0])
    send = group.send([theirs], 0, 0)
    store.wait(["rank0-returned"])  # the default timeout: a deadlock fails the test
    buf = torch.empty(2)
    group.recv([buf], 0, 0).wait()
    send.wait()
    second = collectives.all_reduce(torch.tensor([100.0, 200.0]), group)
    return {"received": buf.tolist(), "second": second.tolist()}


def test_an_exchange_returns_on_what_it_received_and_sends_a_copy():
    out = run_workers(_exchange_without_waiting_for_the_send, 2, timeout_s=60)
    assert out[0]["parts"] == [[1.0, 2.0], [3.0, 4.0]]
    assert out[1]["received"] == [1.0, 2.0]  # the copy, not the tensor as changed afterwards
    assert out[0]["second"] == out[1]["second"] == [110.0, 220.0]
    # the first exchange's send was waited for in the second; only the second's is left
    assert out[0]["unreaped"] == {1: 1}


def _flush_then_die(rank: int, world_size: int) -> dict:
    import os

    import torch
    import torch.distributed as dist
    from tpflex_trainer.ntp import collectives

    store = dist.distributed_c10d._get_default_store()  # served by rank 0, which lives on
    group = dist.new_group([0, 1])
    if rank == 1:
        collectives.Exchange(torch.tensor([5.0, 6.0]), group).wait()
        store.set("flushing", b"1")
        # rank 0 posts its receive for our send only now: flush_sends waits for it
        store.set("failed", str(collectives.flush_sends(timeout_s=25.0)).encode())
        os._exit(0)  # gone without a goodbye, right after the flush
    theirs = torch.empty(2)
    mine = torch.tensor([7.0, 8.0])
    send = group.send([mine], 1, 0)
    store.wait(["flushing"])
    group.recv([theirs], 1, 0).wait()
    send.wait()
    return {"received": theirs.tolist(), "failed": store.get("failed").decode()}


def test_a_process_that_flushes_before_it_dies_has_delivered_its_last_exchange():
    out = run_workers(_flush_then_die, 2, timeout_s=60, expect_exits=1)
    assert out == {0: {"received": [5.0, 6.0], "failed": "0"}}


def _flush_to_a_dead_peer(rank: int, world_size: int) -> dict:
    import os
    import time

    import torch
    import torch.distributed as dist
    from tpflex_trainer.ntp import collectives

    group = dist.new_group([0, 1])
    if rank == 1:
        group.send([torch.tensor([1.0])], 0, 0).wait()
        os._exit(0)  # never receives rank 0's part
    parts = collectives.Exchange(torch.tensor([2.0]), group).wait()
    began = time.monotonic()
    failed = collectives.flush_sends(timeout_s=2.0)
    return {"parts": [p.tolist() for p in parts], "failed": failed, "took_s": time.monotonic() - began,
            "left": len(collectives._UNREAPED)}


def test_a_flush_gives_up_on_a_send_to_a_dead_peer_within_its_bound():
    out = run_workers(_flush_to_a_dead_peer, 2, timeout_s=60, expect_exits=1)
    assert out[0]["parts"] == [[2.0], [1.0]]
    assert out[0]["failed"] == 1 and out[0]["left"] == 0
    # it ends long before the group's 30 s collective timeout: here gloo reports the closed
    # connection; where it leaves the send queued (see ntp.collectives), the bound ends it
    assert out[0]["took_s"] < 20.0, out[0]
