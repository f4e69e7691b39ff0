"""Running a console script on input it must refuse: under a 4 GB address-space limit (a
regression cannot take the machine's memory), it exits 2 without a traceback."""

from __future__ import annotations

import resource
import subprocess


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4_000_000_000, 4_000_000_000))


def refused(cmd: list[str], timeout: float) -> str:
    """``cmd``'s stderr, once it exited 2 with no traceback. ``timeout`` only guards the
    suite against a hang."""
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=_limit_memory)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, proc.stderr
    return proc.stderr
