"""CPU lists (``rest.cpus``): the Linux cpulist syntax (``"6-7"``, ``"0,2,4-5"``), a check
that the kernel lets this process run there, and pinning every thread of a process."""

from __future__ import annotations

import os
import re
import threading

MAX_CPUS = 1 << 16
_NUMBER = re.compile(r"[0-9]+")  # ASCII digits only (str.isdigit also takes '١')


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0,2,4-5"`` -> {0, 2, 4, 5}; ValueError with a message on anything else."""
    cpus: set[int] = set()
    for item in text.replace(" ", "").split(","):
        lo, sep, hi = item.partition("-")
        if not _NUMBER.fullmatch(lo) or (sep and not _NUMBER.fullmatch(hi)):
            raise ValueError(f"not a CPU list item: {item!r} (expected N or N-M, e.g. '6-7' or '0,2,4-5')")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"CPU range {item!r} ends before it starts")
        if last >= MAX_CPUS:
            raise ValueError(f"CPU {last} is out of range")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def check_allowed(cpus: frozenset[int]) -> None:
    """ValueError unless the kernel would let a thread of this process run on ``cpus``
    (tried on a throwaway thread, so no thread of the caller moves)."""
    online = os.cpu_count() or 1
    beyond = sorted(c for c in cpus if c >= online)
    if beyond:
        raise ValueError(f"CPU {beyond[0]} does not exist (this machine has CPUs 0-{online - 1})")
    failure: list[OSError] = []

    def attempt() -> None:
        try:
            os.sched_setaffinity(0, cpus)  # 0: this thread only
        except OSError as exc:
            failure.append(exc)

    t = threading.Thread(target=attempt, name="cpu-check")
    t.start()
    t.join()
    if failure:
        raise ValueError(f"this process may not run on CPUs {format_cpu_list(cpus)}: {failure[0].strerror}")


def pin_process(cpus: frozenset[int]) -> None:
    """Every thread of this process, and those it starts from now on, runs on ``cpus``."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def format_cpu_list(cpus: frozenset[int] | set[int]) -> str:
    """{0, 2, 4, 5} -> ``"0,2,4-5"``."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)
