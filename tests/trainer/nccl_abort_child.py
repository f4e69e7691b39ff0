"""One rank on one GPU (run by test_gpu_liveness.py in its own process, so a hang cannot
take the test runner with it): an NCCL receive that no send matches hangs on the GPU; the
hooks' watchdog (limit WATCHDOG_S, shorter than the group's collective timeout) fires and
aborts the groups through ``abort_groups`` -- the code the plan stream's restart epoch
runs too -- from its own thread. The process must survive (TORCH_NCCL_ASYNC_ERROR_HANDLING
=2), the blocked wait must end, and a new group formed afterwards (the hooks' re-init)
must work. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "trainer_hooks"))
from tpflex_trainer.hooks.watchdog import Watchdog, abort_groups  # noqa: E402


def main() -> int:
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # what the hooks set
    watchdog_s, timeout_s = float(os.environ.get("WATCHDOG_S", "3")), 60.0
    torch.cuda.set_device(0)
    store = dist.HashStore()
    dist.init_process_group("nccl", store=dist.PrefixStore("g1/", store), rank=0, world_size=1,
                            timeout=timedelta(seconds=timeout_s), device_id=torch.device("cuda", 0))
    sub = dist.new_group([0], timeout=timedelta(seconds=timeout_s))
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t, group=sub)
    torch.cuda.synchronize()
    fired: list[float] = []
    dog = Watchdog(watchdog_s, lambda stuck: (fired.append(stuck), abort_groups([sub], f"watchdog {stuck:.1f}s")))
    dog.start()
    error, t0 = "", time.monotonic()
    with dog.guard():
        try:
            buf = torch.zeros(4, device="cuda")
            work = dist.irecv(buf, src=0, group=sub)  # no send matches it: hangs on the GPU
            work.wait()
            torch.cuda.synchronize()
        except Exception as exc:  # what the hooks' train_step catches (RuntimeError / DistError)
            error = f"{type(exc).__name__}: {str(exc)[:200]}"
    unblocked_s = time.monotonic() - t0
    dog.stop()
    # the hooks then re-initialise: destroy, a new default group under a new namespace
    try:
        dist.destroy_process_group()
    except Exception as exc:  # an aborted default group may refuse a clean destroy
        error += f" | destroy: {type(exc).__name__}"
    dist.init_process_group("nccl", store=dist.PrefixStore("g1e1/", store), rank=0, world_size=1,
                            timeout=timedelta(seconds=timeout_s), device_id=torch.device("cuda", 0))
    t = torch.full((4,), 2.0, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    print(json.dumps({"fired": len(fired), "stuck_s": fired[0] if fired else None, "unblocked_s": unblocked_s,
                      "collective_timeout_s": timeout_s, "error": error, "after_reinit": t.tolist(),
                      "async_error_handling": os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"],
                      "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
