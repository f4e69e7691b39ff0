"""When to restart a rank that died, and what the launcher's exit status is (pure)."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    """At most ``max_restarts`` restarts of one rank within ``window_s``; the n-th restart
    in the window waits ``min(backoff_s * 2**(n-1), backoff_max_s)``."""

    max_restarts: int = 3
    window_s: float = 300.0
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0


@dataclass(frozen=True)
class Decision:
    restart: bool
    delay_s: float
    restarts_in_window: int  # before this one


def decide(policy: RestartPolicy, restarted_at: Sequence[float], now: float) -> Decision:
    """A rank died at ``now``; ``restarted_at``: when it was restarted before."""
    recent = sum(1 for t in restarted_at if now - t < policy.window_s)
    if recent >= policy.max_restarts:
        return Decision(False, 0.0, recent)
    return Decision(True, min(policy.backoff_s * 2 ** recent, policy.backoff_max_s), recent)


def describe_exit(returncode: int) -> str:
    """``exit:3``, ``signal:SIGKILL``: the reason logged for a rank's end."""
    if returncode < 0:
        try:
            return f"signal:{signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal:{-returncode}"
    return f"exit:{returncode}"


def shell_status(returncode: int) -> int:
    """A process status as a shell reports it: a signal n is 128 + n."""
    return 128 - returncode if returncode < 0 else returncode


def launcher_status(final: Sequence[int]) -> int:
    """The launcher's exit status from its ranks' final statuses (local-rank order): 0
    when every rank exited 0, else the first failing rank's status (signals as 128+n)."""
    for code in final:
        if code != 0:
            return shell_status(code)
    return 0
