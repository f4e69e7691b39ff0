"""Supervising the node's local ranks: start one process per GPU, restart only the rank
that died (bounded by the restart policy, with backoff), never touch the survivors;
SIGTERM/SIGINT drain every rank (SIGTERM, then SIGKILL after the grace period, at once on
a second signal). One thread: signals and child exits wake a ``select`` through
``signal.set_wakeup_fd``; children are reaped with ``waitpid(-1)`` (so that, as a pod's
PID 1, orphans are reaped too).

With ``preload`` (``tpflex-run --preload``), ranks of a ``python script.py``/``python -m
module`` command are forked from a zygote that imported those modules once
(launch/zygote.py): first starts and restarts skip the imports; their exits come over
the zygote's status sockets, which wake the same ``select``. Any other command, or a
zygote that cannot start, falls back to ``Popen``.

What happens to ranks is told to :class:`RankEvents` observers: the log today, the
controller in part 2 (a soft failure: rank died, GPU healthy).
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tpflex_trainer.launch.devices import LocalGpu
from tpflex_trainer.launch.env import RankSetting, rank_env
from tpflex_trainer.launch.policy import (
    Decision,
    RestartPolicy,
    decide,
    describe_exit,
    launcher_status,
)
from tpflex_trainer.launch.zygote import (
    Entry,
    Zygote,
    ZygoteError,
    ZygoteProc,
    entry_of,
    exited_children,
)

log = logging.getLogger("tpflex_run")

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_MAX_IDLE_S = 1.0


@dataclass
class Rank:
    local_rank: int
    gpu: LocalGpu
    proc: subprocess.Popen | ZygoteProc | None = None
    restarted_at: list[float] = field(default_factory=list)
    restart_due: float | None = None
    last_code: int | None = None
    final: int | None = None  # set once the rank is done (finished, given up, drained)
    beat_file: Path | None = None  # the rank's heartbeat file (TPFLEX_BEAT_FILE)
    kill_reason: str = ""  # why tpflex-run killed it ("heartbeat"), reported as the exit reason

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


class RankEvents(Protocol):
    def rank_started(self, rank: Rank) -> None: ...

    def rank_exited(self, rank: Rank, returncode: int, decision: Decision | None) -> None:
        """``decision``: the restart decision, None while draining or after a clean exit."""

    def rank_given_up(self, rank: Rank) -> None: ...


class LogEvents:
    def __init__(self, node: str) -> None:
        self.node = node

    def rank_started(self, rank: Rank) -> None:
        log.info("rank started node=%s local_rank=%d gpu=%d pid=%d restarts=%d", self.node,
                 rank.local_rank, rank.gpu.index, rank.proc.pid, len(rank.restarted_at))

    def rank_exited(self, rank: Rank, returncode: int, decision: Decision | None) -> None:
        reason = describe_exit(returncode)
        if decision is None:
            log.info("rank exited node=%s local_rank=%d gpu=%d reason=%s", self.node,
                     rank.local_rank, rank.gpu.index, reason)
        elif decision.restart:
            log.warning("rank died; restarting it node=%s local_rank=%d gpu=%d reason=%s delay_s=%.1f "
                        "restarts_in_window=%d", self.node, rank.local_rank, rank.gpu.index, reason,
                        decision.delay_s, decision.restarts_in_window)

    def rank_given_up(self, rank: Rank) -> None:
        log.error("rank given up node=%s local_rank=%d gpu=%d reason=%s restarts_in_window=%d",
                  self.node, rank.local_rank, rank.gpu.index, describe_exit(rank.last_code or 0),
                  len(rank.restarted_at))


class Supervisor:
    def __init__(self, command: Sequence[str], gpus: Sequence[LocalGpu], setting: RankSetting, *,
                 policy: RestartPolicy = RestartPolicy(), grace_s: float = 30.0,
                 log_dir: Path | None = None, events: Sequence[RankEvents] = (),
                 base_env: Mapping[str, str] | None = None, beat_dir: Path | None = None,
                 beat_timeout_s: float = 0.0, preload: Sequence[str] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.command, self.setting, self.policy = list(command), setting, policy
        self.grace_s, self.log_dir, self._clock = grace_s, log_dir, clock
        self.events = list(events) or [LogEvents(setting.node)]
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.ranks = [Rank(i, g) for i, g in enumerate(gpus)]
        self._stop_signal = 0
        self._kill_at: float | None = None
        # a rank whose heartbeat file is older than beat_timeout_s (its process frozen or
        # wedged: SIGSTOP, D state) is killed and restarted like a rank that died
        self.beat_dir, self.beat_timeout_s = beat_dir, beat_timeout_s
        self.preload = list(preload)
        self._zygote: Zygote | None = None
        self._entry: Entry | None = None

    # ---- the loop ----

    def run(self) -> int:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        previous = {s: signal.signal(s, _noop) for s in (*_STOP_SIGNALS, signal.SIGCHLD)}
        old_fd = signal.set_wakeup_fd(wake_w)
        try:
            self._start_zygote()
            for rank in self.ranks:
                self._start(rank)
            while not all(r.final is not None for r in self.ranks):
                self._wait(wake_r)
                self._reap()
                self._start_due()
                self._enforce_grace()
                self._check_beats()
            status = launcher_status([r.final for r in self.ranks])
            log.info("all ranks done node=%s status=%d", self.setting.node, status)
            return status
        finally:
            signal.set_wakeup_fd(old_fd)
            for s, handler in previous.items():
                signal.signal(s, handler)
            self._kill_all(signal.SIGKILL)  # never leave ranks behind
            if self._zygote is not None:
                self._zygote.close()
            os.close(wake_r)
            os.close(wake_w)

    def _wait(self, wake_r: int) -> None:
        now = self._clock()
        due = [r.restart_due for r in self.ranks if r.restart_due is not None]
        if self._kill_at is not None:
            due.append(self._kill_at)
        idle = min(_MAX_IDLE_S, self.beat_timeout_s / 4) if self.beat_timeout_s > 0 else _MAX_IDLE_S
        timeout = min([idle, *(max(0.0, d - now) for d in due)])
        forked = [r.proc for r in self.ranks if isinstance(r.proc, ZygoteProc) and r.running]
        ready, _, _ = select.select([wake_r, *forked], [], [], timeout)
        if wake_r not in ready:
            return
        try:
            data = os.read(wake_r, 512)
        except BlockingIOError:
            return
        for signum in data:
            if signum in _STOP_SIGNALS:
                self._on_stop_signal(signal.Signals(signum))

    def _on_stop_signal(self, sig: signal.Signals) -> None:
        if self._stop_signal:  # a second signal: no more grace
            log.warning("second signal; killing ranks node=%s signal=%s", self.setting.node, sig.name)
            self._kill_all(signal.SIGKILL)
            return
        self._stop_signal = int(sig)
        self._kill_at = self._clock() + self.grace_s
        log.warning("draining ranks node=%s signal=%s grace_s=%.1f", self.setting.node, sig.name, self.grace_s)
        for rank in self.ranks:
            if rank.final is None and not rank.running:  # waiting for a restart: stays down
                rank.restart_due, rank.final = None, rank.last_code if rank.last_code is not None else 0
        self._kill_all(signal.SIGTERM)

    def _enforce_grace(self) -> None:
        if self._kill_at is not None and self._clock() >= self._kill_at and any(r.running for r in self.ranks):
            log.warning("grace period over; killing ranks node=%s grace_s=%.1f", self.setting.node, self.grace_s)
            self._kill_all(signal.SIGKILL)
            self._kill_at = None

    # ---- ranks ----

    def _start_zygote(self) -> None:
        if not self.preload:
            return
        self._entry = entry_of(self.command)
        python = shutil.which(self.command[0]) if self._entry is not None else None
        if python is None:
            log.warning("--preload: not a `python SCRIPT` or `python -m MODULE` command; starting ranks "
                        "with Popen node=%s", self.setting.node)
            return
        try:
            self._zygote = Zygote(python, self.preload, env=self.base_env)
        except ZygoteError as exc:
            log.warning("--preload: no zygote (%s); starting ranks with Popen node=%s", exc, self.setting.node)
            return
        log.info("zygote ready node=%s preload=%s pid=%d", self.setting.node, ",".join(self.preload),
                 self._zygote.proc.pid)

    def _spawn(self, env: dict[str, str], out) -> subprocess.Popen | ZygoteProc:
        if self._zygote is not None:
            fd = out.fileno() if out is not None else None
            try:
                return self._zygote.spawn(self._entry, self.command, env, stdout=fd, stderr=fd)
            except ZygoteError as exc:
                log.error("zygote failed; starting ranks with Popen node=%s error=%s", self.setting.node, exc)
                self._zygote.close()
                self._zygote = None
        return subprocess.Popen(self.command, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                start_new_session=True)

    def _start(self, rank: Rank) -> None:
        env = rank_env(self.base_env, self.setting, rank.gpu, rank.local_rank, len(self.ranks),
                       len(rank.restarted_at))
        rank.kill_reason = ""
        if self.beat_dir is not None:
            rank.beat_file = self.beat_dir / f"rank-{rank.local_rank}.beat"
            rank.beat_file.unlink(missing_ok=True)  # watched from the new process's first beat
            env["TPFLEX_BEAT_FILE"] = str(rank.beat_file)
        out = None
        if self.log_dir is not None:
            out = open(self.log_dir / f"{self.setting.node}-rank-{rank.local_rank}.log", "ab")  # noqa: SIM115
        try:
            rank.proc = self._spawn(env, out)
        except OSError as exc:
            log.error("rank not started node=%s local_rank=%d error=%s", self.setting.node, rank.local_rank, exc)
            rank.proc = None
            self._on_exit(rank, 127)
            return
        finally:
            if out is not None:
                out.close()
        for e in self.events:
            e.rank_started(rank)

    def _reap(self) -> None:
        for rank in self.ranks:  # ranks forked by the zygote: their exits come from it
            if isinstance(rank.proc, ZygoteProc) and rank.running and rank.proc.poll() is not None:
                _signal_group(rank.proc.pid, signal.SIGKILL)
                self._on_exit(rank, rank.proc.returncode)
        by_pid = {r.proc.pid: r for r in self.ranks if r.running}
        for pid, code in exited_children():
            rank = by_pid.get(pid)
            if rank is None:
                continue  # an orphan reparented to us (PID 1 in a pod): reaped, nothing else
            rank.proc.returncode = code
            _signal_group(pid, signal.SIGKILL)  # what the rank left behind dies with it
            self._on_exit(rank, code)

    def _on_exit(self, rank: Rank, code: int) -> None:
        rank.last_code = code
        if self._stop_signal or code == 0:
            rank.final = code
            for e in self.events:
                e.rank_exited(rank, code, None)
            return
        decision = decide(self.policy, rank.restarted_at, self._clock())
        for e in self.events:
            e.rank_exited(rank, code, decision)
        if decision.restart:
            rank.restart_due = self._clock() + decision.delay_s
        else:
            rank.final = code
            for e in self.events:
                e.rank_given_up(rank)

    def _start_due(self) -> None:
        now = self._clock()
        for rank in self.ranks:
            if rank.restart_due is not None and rank.restart_due <= now and not self._stop_signal:
                rank.restart_due = None
                rank.restarted_at.append(now)
                self._start(rank)

    def _check_beats(self) -> None:
        if self.beat_timeout_s <= 0 or self._stop_signal:
            return
        now = time.time()  # file times are wall-clock
        for rank in self.ranks:
            if not rank.running or rank.beat_file is None or rank.kill_reason:
                continue
            try:
                age = now - rank.beat_file.stat().st_mtime
            except FileNotFoundError:
                continue  # no beat yet: still starting
            if age > self.beat_timeout_s:
                log.warning("rank stopped beating; killing it node=%s local_rank=%d gpu=%d pid=%d "
                            "silent_s=%.1f", self.setting.node, rank.local_rank, rank.gpu.index,
                            rank.proc.pid, age)
                rank.kill_reason = "heartbeat"
                _signal_group(rank.proc.pid, signal.SIGKILL)

    def _kill_all(self, sig: signal.Signals) -> None:
        for rank in self.ranks:
            if rank.running:
                _signal_group(rank.proc.pid, sig)


def _noop(signum, frame) -> None:
    """A Python-level handler, so that the signal reaches the wake-up fd."""


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)  # the rank leads its own session: its helpers get it too
    except (ProcessLookupError, PermissionError):
        pass
