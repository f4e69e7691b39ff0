"""One rank of the demo's training job: a plain training script using TpflexHooks.

Run by the demo's launcher as ``python -m tpflex_trainer.demo.worker`` with the TPFLEX_*
environment; writes one JSON line per completed step and per applied plan to
``TPFLEX_DEMO_OUT`` so the demo can tell its story and check parity afterwards.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import torch

from tpflex_trainer.demo.model import DEMO_ADAM, DEMO_SEED, demo_model
from tpflex_trainer.hooks.config import HooksConfigError
from tpflex_trainer.hooks.trainer import HooksError, TpflexHooks
from tpflex_trainer.train.worker import degrees


def main() -> int:
    torch.set_num_threads(1)
    logging.basicConfig(level=os.environ.get("TPFLEX_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s rank-%(process)d %(name)s %(message)s")
    steps = int(os.environ.get("TPFLEX_DEMO_STEPS", "100"))
    out = open(os.environ["TPFLEX_DEMO_OUT"], "a", buffering=1)
    try:
        model = demo_model(os.environ.get("TPFLEX_DEMO_MODEL") or None)
        hooks = TpflexHooks.from_env(model.model, adam=DEMO_ADAM, seed=DEMO_SEED)
    except (HooksConfigError, HooksError) as exc:
        print(f"tpflex-demo worker: {exc}", file=sys.stderr)
        return 2
    seen = 0

    def record(kind: str, **fields) -> None:
        out.write(json.dumps({"kind": kind, "rank": hooks.rank, "t": time.time(), **fields}) + "\n")

    def flush_history() -> None:
        nonlocal seen
        for a in hooks.history[seen:]:
            record("applied", generation=a.generation, tp=a.tp_degree, world=a.world_size,
                   source=a.source, step=a.step, reshard_s=a.reshard_s, bytes_moved=a.bytes_moved,
                   peer_units=a.peer_units, after_failure=a.after_failure, at=a.applied_at,
                   bytes_sent=a.bytes_sent)
        seen = len(hooks.history)

    hooks.start()
    flush_history()
    while hooks.step < steps:
        t0 = time.perf_counter()
        step = hooks.step
        loss = hooks.train_step(model.batch)
        flush_history()
        if loss is None:
            continue
        layout = hooks.runtime.layout
        record("step", step=hooks.step - 1, loss=loss, generation=hooks.generation, tp=hooks.tp_degree,
               global_batch=layout.global_batch, seconds=time.perf_counter() - t0,
               degrees=degrees(hooks.runtime), started_at=step)
    hooks.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
