"""When the plan stream makes a rank abort its process groups (``abort_reason``, pure), and
the gloo abort itself (``GroupSockets``): a collective blocked on a peer that never
enters it ends at once, with real gloo processes."""

from __future__ import annotations

import threading
import time

import pytest
from tpflex_proto import types_pb2
from tpflex_trainer.hooks.abort import GroupSockets, RoundAborts, abort_reason

from tests.trainer.harness import run_workers


def _plan(generation: int, gpus: list[tuple[str, int]], cause: str = "", epoch: int = 0) -> types_pb2.Plan:
    plan = types_pb2.Plan(job="j", generation=generation, cause=cause)
    plan.restart.epoch = epoch
    plan.restart.reason = "rank 3 exited: signal:SIGKILL" if epoch else ""
    rep = plan.replicas.add(tp_degree=len(gpus))
    rep.stages.add().gpus.extend(types_pb2.GpuRef(node=n, index=i) for n, i in gpus)
    return plan


FOUR = [("n0", 0), ("n0", 1), ("n0", 2), ("n0", 3)]


def test_a_failure_generation_dropping_a_gpu_of_the_applied_round_aborts():
    applied = _plan(4, FOUR)
    assert abort_reason(_plan(5, FOUR[:3], "gpu_failed"), applied, 0) == "generation 5 (gpu_failed) drops n0:3"
    assert abort_reason(_plan(5, FOUR, "", epoch=2), applied, 1) == "restart epoch 2: rank 3 exited: signal:SIGKILL"


@pytest.mark.parametrize("plan, epoch", [
    (_plan(5, FOUR[:3], "drain"), 0),  # planned: the leaving rank hands its units over
    (_plan(5, FOUR[:3], "node_lost"), 0),  # its ranks may live on: a step-boundary transition
    (_plan(5, FOUR + [("n1", 0)], "gpu_failed"), 0),  # a failure elsewhere drops none of ours
    (_plan(4, FOUR[:3], "gpu_failed"), 0),  # not newer than the applied generation
    (_plan(4, FOUR, "", epoch=1), 1),  # the applied epoch again
])
def test_planned_changes_and_rounds_already_applied_do_not_abort(plan, epoch):
    assert abort_reason(plan, _plan(4, FOUR), epoch) == ""


def test_nothing_applied_yet_aborts_only_for_a_restart_epoch():
    assert abort_reason(_plan(5, FOUR[:3], "gpu_failed"), None, 0) == ""
    assert abort_reason(_plan(5, FOUR, "", epoch=1), None, 0).startswith("restart epoch 1")


def _blocked_collective(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    sockets = GroupSockets()
    with sockets.track():
        sub = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(2), group=sub)  # the group works
    if rank == 1:  # alive, its connections open, but never in the next collective
        store.wait(["done"])
        return {"tracked": sockets.tracked()}
    stopper = threading.Thread(target=lambda: (time.sleep(0.5), sockets.shutdown()), daemon=True)
    stopper.start()
    with pytest.raises(RuntimeError, match="(?i)connection closed"):  # not a timeout
        dist.all_reduce(torch.ones(2), group=sub)
    stopper.join()
    store.set("done", b"1")  # the store's connection was not touched
    return {"tracked": sockets.tracked()}


def test_shutting_a_gloo_groups_connections_down_ends_a_blocked_collective():
    out = run_workers(_blocked_collective, 2, timeout_s=50)  # under the collective timeout (60 s)
    assert out[0]["tracked"] >= 1 and out[1]["tracked"] >= 1


def _aborts(guarded_since) -> RoundAborts:
    return RoundAborts(groups=lambda: [], applied=lambda: (None, 0), active=lambda: True, sockets=None,
                       label="job=j rank=3", guarded_since=guarded_since)


def test_an_abort_that_did_not_end_the_collectives_puts_the_stacks_in_the_log(caplog, capfd):
    at = time.monotonic()
    with caplog.at_level("WARNING"):
        _aborts(lambda: at - 1.0)._check_freed(at, "watchdog: stuck 30.0s")
    assert any("abort did not end the collectives job=j rank=3" in r.getMessage() for r in caplog.records)
    err = capfd.readouterr().err
    assert "_check_freed" in err and "test_abort.py" in err  # this thread's stack, innermost first


@pytest.mark.parametrize("since", [None, 5.0])  # no guarded section, or one entered after the abort
def test_an_abort_that_freed_the_rank_dumps_nothing(caplog, capfd, since):
    with caplog.at_level("WARNING"):
        _aborts(lambda: since)._check_freed(4.0, "watchdog: stuck 30.0s")
    assert not caplog.records
    assert "Thread" not in capfd.readouterr().err
