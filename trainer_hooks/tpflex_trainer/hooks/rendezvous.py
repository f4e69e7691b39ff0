"""Per-generation rendezvous of the job's processes on a shared key-value store.

Every plan generation gets its own namespace in the store (``<job>/g<generation>/``). A
process that is in generation G's world announces itself there and waits until every
member of that world has arrived, then initialises the default process group from the
same namespace. Waiting is done in short slices so the caller can give up on G when a
newer generation appears (someone who would never arrive, e.g. a rank that died after
G was planned, must not hang the survivors).

The store (``TPFLEX_STORE``) is either the control plane's rendezvous store
(``tpflex://`` = the controller endpoints of TPFLEX_CONTROLLER, or
``tpflex://HOST:PORT[,HOST:PORT]``; what ``tpflex-run`` sets) or a
``torch.distributed.TCPStore`` at ``HOST:PORT`` served by a launcher (``tpflex-demo``);
the hooks are clients only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta

import torch.distributed as dist

from tpflex_trainer.hooks.control import ControlConfig, endpoints_from
from tpflex_trainer.hooks.store_client import STORE_SCHEME
from tpflex_trainer.ntp.groups import FORMATION_TIMEOUT, set_collective_timeout
from tpflex_trainer.ntp.layout import Member

log = logging.getLogger(__name__)


class RendezvousAbandoned(RuntimeError):
    """A newer generation appeared (or the deadline passed) before everyone arrived."""


def connect_store(address: str, timeout_s: float = 30.0, *,
                  control: ControlConfig | None = None) -> dist.Store:
    """The job's store: ``tpflex://[HOST:PORT,...]`` -> the controller's rendezvous store
    (``control`` gives the job, TLS and, without addresses, the endpoints), ``HOST:PORT``
    -> a TCPStore client."""
    if address.startswith(STORE_SCHEME):
        from tpflex_trainer.hooks.store import ControllerStore

        if control is None:
            raise ValueError(f"a {STORE_SCHEME} store needs the controller settings")
        endpoints = endpoints_from(address[len(STORE_SCHEME):]) or control.endpoints
        config = dataclasses.replace(control, endpoints=endpoints)
        return ControllerStore(config, timeout=timedelta(seconds=timeout_s))
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"store address must be HOST:PORT or {STORE_SCHEME}[HOST:PORT,...], got {address!r}")
    return dist.TCPStore(
        host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def _member_key(m: Member) -> str:
    """One key per member: with pipeline stages, (replica, slot) repeats across stages."""
    return f"member/{m.replica}/{m.slot}/{m.stage}"


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
    if prefixed.check([_member_key(me)]):
        # a previous process of this rank joined this round (it died since): its peers'
        # addresses here are stale for us; the controller's next round (the restart epoch
        # its death raises) is the one to join
        raise RendezvousAbandoned(f"generation {generation}: member {tuple(me)} was here before "
                                  "(a previous process of this rank)")
    prefixed.set(_member_key(me), "1")
    keys = [_member_key(m) for m in world]
    deadline = time.monotonic() + deadline_s
    pause = 0.002
    while True:  # polled: store.wait() logs a warning per time-out
        why = ""
        if prefixed.check(keys):
            if _settle(prefixed, _GO) == _GO:
                break
            why = "another member abandoned it"
        elif give_up():
            why = "a newer plan arrived"
        elif time.monotonic() > deadline:
            missing = [k for k in keys if not prefixed.check([k])]
            why = f"members {missing} did not arrive in {deadline_s:.0f}s"
        if why and _settle(prefixed, _ABANDONED) == _ABANDONED:
            raise RendezvousAbandoned(f"generation {generation}: {why}")
        if why:
            break  # the others already formed it (our key counted): join them
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    log.info("rendezvous formed job=%s generation=%s rank=%d world=%d: forming the process group",
             job, generation, world[me], len(world))
    if dist.is_initialized():
        dist.destroy_process_group()
    # the default group's store namespace is named by torch's group counter, which a failed
    # init_process_group leaves raised: every member must start from the same count
    dist.distributed_c10d._world.group_count = 0
    # a member may die after the round formed, before it connects: its peers then wait in
    # init_process_group; a store that can give up (ControllerStore) ends that wait when
    # the controller announces a newer round (the death raises the restart epoch)
    try:
        with store_gives_up(store, give_up):
            dist.init_process_group(
                backend,
                store=dist.PrefixStore("pg/", prefixed),
                rank=world[me],
                world_size=len(world),
                timeout=min(collective_timeout, FORMATION_TIMEOUT),  # see FORMATION_TIMEOUT
            )
        set_collective_timeout(None, collective_timeout)
    except dist.DistStoreError as exc:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise RendezvousAbandoned(f"generation {generation}: process group not formed: {exc}") from exc
    log.info("rendezvous complete job=%s generation=%s rank=%d world=%d", job, generation, world[me], len(world))


@contextlib.contextmanager
def store_gives_up(store: dist.Store | None, give_up: Callable[[], bool]) -> Iterator[None]:
    """While inside, a blocking ``get``/``wait`` on ``store`` ends (``DistStoreError``) once
    ``give_up()`` is true, if the store can give up (``ControllerStore``; a TCPStore waits
    out its timeout). Process groups formed inside wait for their members' addresses
    through this store: a member that died will never publish its own. Restores the
    previous condition on leaving (nested uses)."""
    if store is None or not hasattr(store, "give_up"):
        yield
        return
    previous, store.give_up = store.give_up, give_up
    try:
        yield
    finally:
        store.give_up = previous


_GO, _ABANDONED = b"go", b"abandoned"


def _settle(prefixed: dist.Store, outcome: bytes) -> bytes:
    """A round is formed or abandoned once, for every member alike: the first member to
    see everyone arrive (go) or to give up (abandoned) decides it by compare-and-set, and
    a member that finds it decided the other way follows that decision. Without this, a
    member could give up after the others counted its key and formed the group without
    it, leaving them blocked in ``init_process_group`` until the store's timeout."""
    return bytes(prefixed.compare_set("state", "", outcome))


def forget_generation(store: dist.Store, job: str, generation: int) -> None:
    """Drop generation ``generation``'s namespace from a store that can delete by prefix
    (the controller's; a TCPStore lives only as long as its launcher). In the background:
    the step never waits for it, and a failure only leaves keys for the store's TTL."""
    drop = getattr(store, "delete_prefix", None)
    if drop is None:
        return

    def run() -> None:
        try:
            for suffix in ("", "a"):
                drop(f"tpflex/{job}/g{generation}{suffix}/")
        except (RuntimeError, TimeoutError) as exc:
            log.warning("rendezvous namespace not dropped job=%s generation=%s error=%s", job, generation, exc)

    threading.Thread(target=run, name="tpflex-store-gc", daemon=True).start()
