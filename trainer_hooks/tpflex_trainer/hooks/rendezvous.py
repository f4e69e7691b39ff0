"""Per-generation rendezvous of the job's processes on a shared key-value store.

Every plan generation gets its own namespace in the store (``<job>/g<generation>/``). A
process that is in generation G's world announces itself there and waits until every
member of that world has arrived, then initialises the default process group from the
same namespace. Waiting is done in short slices so the caller can give up on G when a
newer generation appears (someone who would never arrive, e.g. a rank that died after
G was planned, must not hang the survivors).

The store is a ``torch.distributed.TCPStore`` served by the launcher (torchrun's c10d
store, or ``tpflex-demo``); the hooks are clients only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from datetime import timedelta

import torch.distributed as dist

from tpflex_trainer.ntp.layout import Member

log = logging.getLogger(__name__)


class RendezvousAbandoned(RuntimeError):
    """A newer generation appeared (or the deadline passed) before everyone arrived."""


def connect_store(address: str, timeout_s: float = 30.0) -> dist.TCPStore:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"store address must be HOST:PORT, got {address!r}")
    return dist.TCPStore(
        host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def _member_key(m: Member) -> str:
    return f"member/{m.replica}/{m.slot}"


def join_generation(
    store: dist.Store,
    job: str,
    generation: int | str,
    world: Mapping[Member, int],
    me: Member,
    *,
    backend: str,
    collective_timeout: timedelta,
    give_up: Callable[[], bool],
    deadline_s: float,
) -> None:
    """Re-initialise the default process group as member ``me`` of generation
    ``generation``'s ``world``. Raises RendezvousAbandoned if ``give_up()`` turns true or
    the deadline passes before all members arrived."""
    prefixed = dist.PrefixStore(f"tpflex/{job}/g{generation}/", store)
    prefixed.set(_member_key(me), "1")
    keys = [_member_key(m) for m in world]
    deadline = time.monotonic() + deadline_s
    pause = 0.002
    while not prefixed.check(keys):  # polled: store.wait() logs a warning per time-out
        if give_up():
            raise RendezvousAbandoned(f"generation {generation}: a newer plan arrived")
        if time.monotonic() > deadline:
            missing = [k for k in keys if not prefixed.check([k])]
            raise RendezvousAbandoned(
                f"generation {generation}: members {missing} did not arrive in {deadline_s:.0f}s"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("pg/", prefixed),
        rank=world[me],
        world_size=len(world),
        timeout=collective_timeout,
    )
    log.info("rendezvous complete job=%s generation=%d rank=%d world=%d", job, generation, world[me], len(world))
