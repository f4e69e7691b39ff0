"""One rank of the demo's training job: a plain training script using TpflexHooks.

Run by the demo's launcher (or tpflex-run) as ``python -m tpflex_trainer.demo.worker``
with the TPFLEX_* environment; writes one JSON line per completed step and per applied
plan (with the process id and its restart count) to ``TPFLEX_DEMO_OUT`` so the demo, the
liveness tests and bench/soak.py can tell what happened and check parity afterwards.

Optional: ``TPFLEX_DEMO_FINAL_DIR`` (write a checkpoint of the final state there: weights
and Adam moments, for weight parity), ``TPFLEX_DEMO_STOP_FILE`` (a file that may name a
step to stop at, read at every step: a soak ends every rank at the same step),
``TPFLEX_DEMO_STEP_MIN_S`` (pace the steps, so that a test's fault lands mid-training),
``TPFLEX_DEMO_DIGESTS=1`` (record, per round, a digest of the state its first step started
from: the soak compares them with its replay's), ``TPFLEX_DEMO_HOLD_FILE`` (a file that may hold ``STEP GENERATION``: an active rank does not
start step STEP or later before its plan stream has delivered plan GENERATION; the story
holds the job there until the plan its repair causes arrives, so a short job cannot finish
before the repaired GPU's plan), ``TPFLEX_DEMO_DUMP_DIR`` (full-state dumps around the start
of each plan generation, for the soak's oracle: ``demo/dumps.py``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import torch

from tpflex_trainer.demo.dumps import DUMP_ENV, StateDumps
from tpflex_trainer.demo.model import DEMO_ADAM, DEMO_SEED, demo_model
from tpflex_trainer.hooks.config import HooksConfigError
from tpflex_trainer.hooks.trainer import HooksError, RefusedByController, TpflexHooks
from tpflex_trainer.ntp.state import state_digest
from tpflex_trainer.train.worker import degrees


def main() -> int:
    torch.set_num_threads(1)
    logging.basicConfig(level=os.environ.get("TPFLEX_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s rank-%(process)d %(name)s %(message)s")
    steps = int(os.environ.get("TPFLEX_DEMO_STEPS", "100"))
    pace = float(os.environ.get("TPFLEX_DEMO_STEP_MIN_S", "0") or 0)
    stop_file = os.environ.get("TPFLEX_DEMO_STOP_FILE", "")
    hold_file = os.environ.get("TPFLEX_DEMO_HOLD_FILE", "")
    incarnation = int(os.environ.get("TPFLEX_RESTART_COUNT", "0") or 0)
    out = open(os.environ["TPFLEX_DEMO_OUT"], "a", buffering=1)
    try:
        model = demo_model(os.environ.get("TPFLEX_DEMO_MODEL") or None)
        hooks = TpflexHooks.from_env(model.model, adam=DEMO_ADAM, seed=DEMO_SEED)
    except (HooksConfigError, HooksError) as exc:
        print(f"tpflex-demo worker: {exc}", file=sys.stderr)
        return 2
    seen = 0
    digests = os.environ.get("TPFLEX_DEMO_DIGESTS") == "1"
    last_round = None
    dumps = StateDumps(os.environ[DUMP_ENV]) if os.environ.get(DUMP_ENV) else None

    def record(kind: str, **fields) -> None:
        out.write(json.dumps({"kind": kind, "rank": hooks.rank, "t": time.time(), "pid": os.getpid(),
                              "incarnation": incarnation, **fields}) + "\n")

    def flush_history() -> None:
        nonlocal seen
        for a in hooks.history[seen:]:
            record("applied", generation=a.generation, tp=a.tp_degree, world=a.world_size,
                   source=a.source, step=a.step, reshard_s=a.reshard_s, bytes_moved=a.bytes_moved,
                   peer_units=a.peer_units, after_failure=a.after_failure, at=a.applied_at,
                   bytes_sent=a.bytes_sent, epoch=a.epoch, behind=[list(m) for m in a.behind])
        seen = len(hooks.history)

    try:
        hooks.start()
    except RefusedByController as exc:  # the model contradicts the spec: no use retrying
        print(f"tpflex-demo worker: {exc}", file=sys.stderr)
        hooks.close()
        return 2
    flush_history()
    while hooks.step < _stop_step(steps, stop_file):
        _hold(hooks, hold_file)
        t0 = time.perf_counter()
        step = hooks.step
        loss = hooks.train_step(model.batch)
        flush_history()
        if loss is None:
            continue
        if digests and (hooks.generation, hooks.epoch) != last_round and hooks.runtime.undo is not None:
            last_round = (hooks.generation, hooks.epoch)  # the state this round's first step started from
            undo = hooks.runtime.undo
            record("entered", step=undo.step, generation=hooks.generation, epoch=hooks.epoch,
                   units={f: list(u) for f, u in undo.units.items()}, digest=state_digest(undo))
        layout = hooks.runtime.layout
        record("step", step=hooks.step - 1, loss=loss, generation=hooks.generation, tp=hooks.tp_degree,
               global_batch=layout.global_batch, seconds=time.perf_counter() - t0,
               degrees=degrees(hooks.runtime), started_at=step)
        if dumps is not None:
            dumps.after_step(hooks)
        time.sleep(max(0.0, pace - (time.perf_counter() - t0)))
    if os.environ.get("TPFLEX_DEMO_FINAL_DIR") and hooks.active:
        hooks.runtime.save_checkpoint(os.environ["TPFLEX_DEMO_FINAL_DIR"])
    record("done", step=hooks.step, watchdog_fired=hooks.watchdog.fired)
    hooks.close()
    return 0


def _stop_step(steps: int, stop_file: str) -> int:
    """``steps``, or the step the stop file names (the soak writes it once, ahead of every
    rank's current step)."""
    if stop_file:
        try:
            return min(steps, int(open(stop_file).read().strip()))
        except (OSError, ValueError):
            pass
    return steps


def _hold(hooks: TpflexHooks, hold_file: str) -> None:
    """Wait at the hold step (see the module doc) until the held-for plan arrived, the
    hold file is gone, or the hooks stop being active; rechecked every second."""
    while hold_file and hooks.active:
        try:
            step, generation = (int(x) for x in open(hold_file).read().split())
        except (OSError, ValueError):
            return
        if hooks.step < step or hooks.generation >= generation:
            return
        if hooks.client.wait_for_generation(generation, 1.0) is not None:
            return


if __name__ == "__main__":
    sys.exit(main())
