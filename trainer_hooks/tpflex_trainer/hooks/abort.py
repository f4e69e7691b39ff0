"""When the plan stream tells a rank to abort its process groups, and how gloo's are aborted.

A survivor blocked in a collective with a member that is gone must not depend on a
transport error (NCCL gives none; a frozen peer's sockets stay open) or on its watchdog.
The controller's plan stream says it: a newer restart epoch (a rank died or hung, its GPU
healthy) or a newer generation that drops, for a failed GPU, a GPU of the round this rank
applied (:func:`abort_reason`). The hooks then abort every process group
(``watchdog.abort_groups``) and re-form them with the new plan.

``ProcessGroupGloo.abort`` does nothing in torch 2.13 (a blocked gloo collective ends only
when a peer's socket closes, or at the collective timeout), so for gloo the hooks also
shut down the TCP connections the groups opened (:class:`GroupSockets`): the blocked
collective raises at once ("connection closed"), as NCCL's aborted one does, and the same
recovery code runs. Only connected sockets that appeared while this process built its
groups are touched (not gloo's listeners, whose shutdown ends the process; not the
controller's or the store's connections); each is checked to be the same socket (its
inode) before it is shut down, so a descriptor number reused since is left alone.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from tpflex_proto import types_pb2

from tpflex_trainer.hooks.control import plan_round
from tpflex_trainer.hooks.watchdog import abort_groups, dump_stacks

log = logging.getLogger(__name__)

# why a plan drops GPUs that are gone: their ranks cannot hand their units over
FAILURE_CAUSES = frozenset({"gpu_failed"})
# A failure generation's abort waits this long, and is skipped when the rank has left its
# round by then: a rank whose peer died sees its sockets close and is already recovering;
# the abort is for the ranks that nothing tells (the peer frozen, or stuck in a driver
# call). Aborting at once, while the others were recovering, left a gloo rank in a send
# until the 60 s collective timeout in 3 of 9 XID 79 faults of the soak.
FAILURE_ABORT_GRACE_S = 2.0
# An abort that has not freed the rank's guarded collectives this long after it: the
# rank's thread stacks go to its log (which collective, which group did not end)
ABORT_CHECK_S = 5.0


def plan_gpus(plan: types_pb2.Plan) -> set[tuple[str, int]]:
    """The GPUs a plan trains on (replicas with a degree). Pure."""
    return {(g.node, g.index) for rep in plan.replicas if rep.tp_degree for st in rep.stages for g in st.gpus}


def abort_reason(plan: types_pb2.Plan, applied: types_pb2.Plan | None, applied_epoch: int) -> str:
    """Why a rank that applied ``applied`` (in restart epoch ``applied_epoch``) must abort
    its process groups on receiving ``plan``, or "" (keep them: a planned change is applied
    together at a step boundary, leaving ranks handing their units over). Pure."""
    if plan.restart.epoch > applied_epoch:
        return f"restart epoch {plan.restart.epoch}: {plan.restart.reason}"
    if applied is None or plan.generation <= applied.generation or plan.cause not in FAILURE_CAUSES:
        return ""
    lost = sorted(plan_gpus(applied) - plan_gpus(plan))
    if not lost:
        return ""
    return f"generation {plan.generation} ({plan.cause}) drops {', '.join(f'{n}:{i}' for n, i in lost)}"


def _sockets() -> dict[int, str]:
    """This process's socket descriptors -> their identity (``socket:[inode]``)."""
    out = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # no procfs: nothing is tracked, gloo's collectives end at their timeout
        return out
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out[int(name)] = link
    return out


class GroupSockets:
    """The TCP connections this process's gloo groups opened (``track`` around the code
    that builds them), and their shutdown (``shutdown``, from any thread)."""

    def __init__(self, keep_ports: Iterable[int] = ()) -> None:
        self.keep_ports = frozenset(keep_ports)  # peers never touched (controller, store)
        self._lock = threading.Lock()
        self._tracked: dict[int, str] = {}
        self.last_shut: list[str] = []  # "fd:peer_port" of the last shutdown, for the log
        self.last_skipped: dict[str, int] = {}  # why the others were not: count by reason

    @contextmanager
    def track(self) -> Iterator[None]:
        before = _sockets()
        try:
            yield
        finally:
            new = {fd: link for fd, link in _sockets().items() if before.get(fd) != link}
            with self._lock:
                live = _sockets()
                self._tracked = {fd: link for fd, link in self._tracked.items() if live.get(fd) == link}
                self._tracked.update(new)

    def tracked(self) -> int:
        with self._lock:
            return len(self._tracked)

    def shutdown(self) -> int:
        """Shut down every tracked connection that is still the same socket; returns how
        many. A collective blocked on one of them fails at once."""
        with self._lock:
            tracked = dict(self._tracked)
        shut = []
        skipped: dict[str, int] = {}
        for fd, link in tracked.items():
            try:
                if os.readlink(f"/proc/self/fd/{fd}") != link:
                    skipped["gone"] = skipped.get("gone", 0) + 1
                    continue
                s = socket.socket(fileno=os.dup(fd))
            except OSError:
                skipped["gone"] = skipped.get("gone", 0) + 1
                continue
            try:
                peer = s.getpeername()  # a listener has none: gloo ends the process if it fails
                if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6) \
                        and peer[1] not in self.keep_ports:
                    s.shutdown(socket.SHUT_RDWR)
                    shut.append(f"{fd}:{peer[1]}")
                else:
                    skipped["kept"] = skipped.get("kept", 0) + 1
            except OSError as exc:
                key = errno.errorcode.get(exc.errno or 0, "error")
                skipped[key] = skipped.get(key, 0) + 1
            finally:
                s.close()  # the duplicate only: the group's descriptor stays its own
        self.last_skipped = skipped
        self.last_shut = shut
        return len(shut)


class RoundAborts:
    """Who aborts a rank's process groups, and when: the plan-stream thread on a newer
    round whose :func:`abort_reason` says a member of this rank's round is gone, and the
    watchdog on a hang. The main thread says which round it is entering (``entering``);
    an abort applies only to a newer round than that one, never to the groups the main
    thread is building for the round itself."""

    def __init__(self, *, groups: Callable[[], Iterable], applied: Callable[[], tuple],
                 active: Callable[[], bool], sockets: GroupSockets | None, label: str,
                 guarded_since: Callable[[], float | None] = lambda: None) -> None:
        self._groups = groups  # -> the live process groups
        self._applied = applied  # -> (plan applied or None, restart epoch applied)
        self._active = active
        self._guarded_since = guarded_since  # -> when the running guarded section began (monotonic)
        self.sockets = sockets  # gloo: whose connections an abort shuts down; NCCL: None
        self.label = label  # for the log: "job=... rank=..."
        self._lock = threading.Lock()
        self._entering = (0, 0)

    def entering(self, round_: tuple[int, int]) -> None:
        with self._lock:  # a plan-stream abort from here on is for a newer round
            self._entering = round_

    def on_round(self, plan: types_pb2.Plan) -> None:
        """Plan-stream thread, each newer round: a restart epoch aborts at once; a
        generation dropping a failed GPU aborts after ``FAILURE_ABORT_GRACE_S`` unless this
        rank has left its round by then (ranks that talked to a dead process learn it from
        their sockets and are already recovering; the abort is for those nothing tells,
        behind a frozen peer)."""
        with self._lock:
            if plan_round(plan) <= self._entering or not self._active():
                return  # the main thread already builds that round's groups (or none)
            applied, epoch = self._applied()
            reason = abort_reason(plan, applied, epoch)
            if not reason:
                return
            if plan.restart.epoch > epoch:
                self.abort(reason)
                return
        timer = threading.Timer(FAILURE_ABORT_GRACE_S, self._abort_if_still_in, (plan, reason))
        timer.daemon = True
        timer.start()

    def _abort_if_still_in(self, plan: types_pb2.Plan, reason: str) -> None:
        with self._lock:
            if plan_round(plan) > self._entering and self._active():
                self.abort(reason)

    def abort(self, reason: str) -> None:
        """Abort every process group (NCCL: a blocked collective ends); with gloo, whose
        abort does nothing, shut the groups' connections down too."""
        at = time.monotonic()
        abort_groups(self._groups(), reason)
        if self.sockets is not None:
            n = self.sockets.shutdown()
            log.warning("gloo connections shut down %s connections=%d tracked=%d skipped=%s reason=%s shut=%s",
                        self.label, n, self.sockets.tracked(), self.sockets.last_skipped, reason,
                        ",".join(self.sockets.last_shut))
        timer = threading.Timer(ABORT_CHECK_S, self._check_freed, (at, reason))
        timer.daemon = True
        timer.start()

    def _check_freed(self, aborted_at: float, reason: str) -> None:
        """``ABORT_CHECK_S`` after an abort: a guarded section entered before it and still
        running is a collective the abort did not end; its stacks go to the log."""
        since = self._guarded_since()
        if since is not None and since <= aborted_at:
            log.error("abort did not end the collectives %s stuck_s=%.1f reason=%s", self.label,
                      time.monotonic() - since, reason)
            dump_stacks(f"abort did not end the collectives ({reason})")
