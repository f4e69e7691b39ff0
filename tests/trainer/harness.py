"""Run a function in N gloo processes on loopback; always reap them.

Workers are forked from a forkserver that has torch and the runtime preloaded, so each
start costs milliseconds instead of a torch import. Every collective runs under the
process-group timeout given here, and the parent kills whatever is still alive at the
deadline.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from tests.support import forkserver
from tests.support.ports import free_port

COLLECTIVE_TIMEOUT = timedelta(seconds=30)
_CTX = forkserver.context()


def init_gloo(rank: int, world_size: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, results) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        init_gloo(rank, world_size, port)
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # report every failure to the parent with its traceback
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    timeout_s: float = 100.0,
    expect_exits: int = 0,
) -> dict[int, Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return rank ->
    result. ``expect_exits`` workers may exit without a result (a killed rank)."""
    results = _CTX.Queue()
    port = free_port()
    procs = [
        _CTX.Process(target=_worker, args=(fn, r, world_size, port, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) + len(errors) < world_size - expect_exits:
            try:
                rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers timed out; got {sorted(out)}") from None
                if not any(p.is_alive() for p in procs):
                    break
                continue
            if status == "ok":
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    missing = world_size - expect_exits - len(out) - len(errors)
    if missing > 0:
        errors.append(f"{missing} workers exited without a result; exit codes {[p.exitcode for p in procs]}")
    if errors:
        raise AssertionError("worker failures:\n" + "\n".join(errors))
    return out
