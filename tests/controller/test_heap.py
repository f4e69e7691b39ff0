"""The controller's C heap (heap.py): the arena cap holds in a fresh process and reaches
its children through the environment; an arena cap the environment gives wins; the
trimmer gives freed memory inside the heap back to the system."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tpflex_controller import heap

pytestmark = pytest.mark.skipif(heap._glibc() is None, reason="glibc only")

_THREADS = """
import json, os, subprocess, sys, threading
from tpflex_controller import heap, memtrace
cap = heap.limit_arenas(2) if sys.argv[1] == "cap" else None
go = threading.Barrier(8)
def work():
    go.wait()
    blocks = [bytearray(4096) for _ in range(200)]  # from malloc: each thread takes an arena
    go.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
[t.start() for t in threads]; [t.join() for t in threads]
stats = dict(kv.split("=") for kv in memtrace.malloc_stats().split())
child = subprocess.run([sys.executable, "-c", "import os; e = os.environ; "
                        "print(e.get('MALLOC_ARENA_MAX', ''), e.get('MALLOC_MMAP_THRESHOLD_', ''))"],
                       capture_output=True, text=True).stdout.strip()
print(json.dumps({"cap": cap, "arenas": int(stats["malloc_arenas"]), "child_env": child}))
"""


def _run(mode: str, env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", _THREADS, mode], capture_output=True, text=True,
                         timeout=60, env=env, check=True)
    return json.loads(out.stdout)


def test_the_arena_cap_holds_and_reaches_children():
    env = {k: v for k, v in os.environ.items() if k != heap.ENV}
    free = _run("free", env)
    assert free["arenas"] > 2 and free["child_env"] == ""  # glibc's default: one per thread
    capped = _run("cap", env)
    assert capped == {"cap": 2, "arenas": 2, "child_env": "2 262144"}
    # the environment's settings (the systemd unit's) win
    given = _run("cap", {**env, heap.ENV: "3", heap.MMAP_ENV: "131072"})
    assert given["cap"] == 3 and given["arenas"] <= 3 and given["child_env"] == "3 131072"


_BIG_BLOCKS = """
import json
from tpflex_controller import heap, memtrace
if sys.argv[1] == "cap":
    heap.limit_arenas()
for _ in range(3):  # a 4 MiB buffer freed raises glibc's own threshold to 4 MiB
    block = bytearray(4 << 20)
    del block
blocks = [bytearray(1 << 20) for _ in range(32)]
mapped = dict(kv.split("=") for kv in memtrace.malloc_stats().split())["malloc_mmap_mb"]
print(json.dumps(float(mapped)))
"""


def test_big_blocks_stay_mapped_apart():
    """After a big block is freed, glibc keeps later big blocks in its arenas (where their
    memory stays when freed) unless the threshold is fixed."""
    env = {k: v for k, v in os.environ.items() if k not in (heap.ENV, heap.MMAP_ENV)}

    def mapped(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", "import sys\n" + _BIG_BLOCKS, mode], capture_output=True,
                             text=True, timeout=60, env=env, check=True)
        return json.loads(out.stdout)

    assert mapped("free") < 8  # MB of the 32 MiB mapped apart: glibc's threshold rose
    assert mapped("cap") >= 32


def test_limit_arenas_refuses_a_cap_below_one():
    with pytest.raises(ValueError):
        heap.limit_arenas(0, environ={})


_FRAGMENTED = """
import json
from tpflex_controller import heap, memtrace
blocks = [bytearray(2048) for _ in range(40000)]  # ~80 MB from malloc
kept = blocks[::16]  # one block in 16 stays: the freed memory lies below the heap's top
del blocks
before = memtrace.rss_mb()
trimmer = heap.HeapTrimmer(interval_s=0.05).start()
assert trimmer.wait_runs(1, 10)
trimmer.stop()
print(json.dumps({"before": before, "after": memtrace.rss_mb(), "kept": len(kept)}))
"""


def test_the_trimmer_gives_freed_heap_memory_back():
    out = json.loads(subprocess.run([sys.executable, "-c", _FRAGMENTED], capture_output=True, text=True,
                                    timeout=60, check=True).stdout)
    assert out["kept"] == 2500
    assert out["before"] - out["after"] > 40  # MB: glibc held ~70 MB free until the trim


def test_the_trimmer_runs_on_its_interval_until_stopped():
    calls = []
    trimmer = heap.HeapTrimmer(interval_s=0.01, trim_fn=lambda: calls.append(1) or True).start()
    assert trimmer.wait_runs(3, 10)
    trimmer.stop()
    n = len(calls)
    assert n >= 3 and trimmer.runs == n
    with pytest.raises(ValueError):
        heap.HeapTrimmer(interval_s=0)
