"""Per-stage timestamps of the controller's failure->commit path (bench/controller_scale.py
``--stages``): wraps, in the controller process, the informer's watch callback, the loop's
batch handler, the re-plan, the commit's build and its transaction (and the etcd client's
call in it), and the loop's work after the commit, and writes one JSON line per committed
generation (``time.perf_counter``: CLOCK_MONOTONIC, comparable with the bench process's
clock). Measurement only."""

from __future__ import annotations

import json
import sys
import threading
import time

from tpflex_controller import planning, reconcile
from tpflex_controller.reconcile import Reconciler
from tpflex_proto.etcd import Etcd
from tpflex_proto.informer import Informer

_lock = threading.Lock()
_pending: dict[str, float] = {}
_rows: list[dict] = []


def _stamp(name: str, only_first: bool = False) -> None:
    with _lock:
        if not (only_first and name in _pending):
            _pending[name] = time.perf_counter()


def _wrap(owner, attr: str, before: str, after: str | None = None, only_first: bool = False):
    fn = getattr(owner, attr)

    def wrapped(*a, **kw):
        _stamp(before, only_first)
        try:
            return fn(*a, **kw)
        finally:
            if after:
                _stamp(after)

    setattr(owner, attr, wrapped)


def install() -> None:
    on_events = Informer._on_events

    def informer_events(self, events):
        if any("/health/" in ev.key for ev in events):
            _stamp("watch")
        return on_events(self, events)

    Informer._on_events = informer_events
    on_batch = Reconciler._on_batch

    def loop_batch(self, batch, at):
        if any(c.parsed is not None and c.parsed.kind.name == "HEALTH" for c in batch.changes):
            _stamp("loop")
            on_batch(self, batch, at)
            _stamp("folded")
        else:
            on_batch(self, batch, at)

    Reconciler._on_batch = loop_batch
    _wrap(reconcile, "replan", "replan", "replanned")
    _wrap(reconcile, "build_commit", "build", "built")
    commit_plan = reconcile.commit_plan

    def timed_commit(session, c):
        _stamp("txn")
        rev = commit_plan(session, c)
        _stamp("committed")
        with _lock:
            _pending["generation"] = c.generation
        return rev

    reconcile.commit_plan = timed_commit
    fenced = planning._fenced

    def timed_fenced(session, compare, ops, job):
        t0 = time.perf_counter()
        rev = fenced(session, compare, ops, job)
        with _lock:
            _pending.setdefault("txns", []).append(
                [round((time.perf_counter() - t0) * 1000, 2), len(compare), len(ops),
                 sum(map(planning._op_size, ops))])
        return rev

    planning._fenced = timed_fenced
    # the commit's transaction as the etcd client sends it (its request built)
    _wrap(Etcd, "txn_request", "grpc", "grpc_done")
    commit = Reconciler._commit

    def after_commit(self, p):
        commit(self, p)
        _stamp("post_commit_done")
        with _lock:
            _rows.append(dict(_pending))
            _pending.clear()

    Reconciler._commit = after_commit


def dump(path: str) -> None:
    """The rows to ``path``; the last commits' transactions (ms, compares, ops, bytes) to
    stderr."""
    with _lock, open(path, "w") as f:
        for row in _rows[-3:]:
            print("# txns ms,compares,ops,bytes", row.get("txns"), file=sys.stderr)
        f.writelines(json.dumps(row) + "\n" for row in _rows)


def load(path: str) -> dict[int, dict[str, float]]:
    """generation -> stage -> perf_counter time, from ``dump``'s file."""
    out = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            gen = row.pop("generation", None)
            row.pop("txns", None)
            if gen is not None:
                out[int(gen)] = row
    return out
