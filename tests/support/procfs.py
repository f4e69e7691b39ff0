"""Reading a process's (or thread's) state from /proc, as the tests check it."""

from __future__ import annotations

from pathlib import Path


def status(pid: int, tid: int | None = None) -> dict[str, str]:
    """The fields of ``/proc/<pid>/status`` (of thread ``tid`` if given), values stripped."""
    path = f"/proc/{pid}/status" if tid is None else f"/proc/{pid}/task/{tid}/status"
    with open(path) as f:
        return {k: v.strip() for k, _, v in (ln.partition(":") for ln in f) if v}


def nice(pid: int) -> int:
    """The process's niceness (field 19 of ``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def children(pid: int) -> list[int]:
    """The child processes of ``pid``, from every thread's /proc children list."""
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids
