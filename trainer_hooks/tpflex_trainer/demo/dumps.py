"""A test hook of the demo worker (``TPFLEX_DEMO_DUMP_DIR``; unset in real runs): full-state
dumps around the start of each plan generation, for the chaos soak's independent oracle
(``bench/soak_oracle.py``).

In the first round of each generation it trains in, every rank writes the units it holds
(weights and Adam moments, ``checkpoint.write_member_units``) twice: the state the round's
first step started from (``entry``: the runtime's undo copy after that step) and the state
after ``steps`` steps of the round (``exit``). Each goes to
``DIR/g<generation>-e<epoch>-s<start step>/<entry|exit>/r<replica>/`` with a JSON sidecar per
member (who wrote it, the step of the state, the layout's degrees and batches), so the
oracle can assemble each replica's whole model and knows when a replica's dump is
complete. A round that ends before its window does leaves the generation open: the next
round of it dumps again. Nothing here takes part in a collective or changes the state.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tpflex_trainer.ntp.checkpoint import write_member_units
from tpflex_trainer.ntp.state import LocalState

DUMP_ENV = "TPFLEX_DEMO_DUMP_DIR"
DUMP_STEPS = 3


class StateDumps:
    def __init__(self, directory: str | os.PathLike, steps: int = DUMP_STEPS) -> None:
        self.directory, self.steps = Path(directory), steps
        self.finished: set[int] = set()  # generations whose window this process dumped to its end
        self.window: tuple[int, int, int] | None = None  # (generation, epoch, start step)

    def after_step(self, hooks) -> None:
        """Call after every completed ``hooks.train_step``."""
        rt = hooks.runtime
        key = (hooks.generation, hooks.epoch)
        if self.window is not None and self.window[:2] != key:
            self.window = None  # a new round (the last one's window ended early, or is done)
        if self.window is None:
            if hooks.generation in self.finished or rt.undo is None or rt.undo.step != rt.step - 1:
                return
            self.window = (*key, rt.undo.step)
            self._write("entry", rt.undo, hooks)
        if rt.step == self.window[2] + self.steps and hooks.generation not in self.finished:
            self._write("exit", rt.state, hooks)
            self.finished.add(hooks.generation)

    def _write(self, phase: str, state: LocalState, hooks) -> None:
        rt = hooks.runtime
        generation, epoch, start = self.window
        member = rt.layout.member(rt.me)
        path = self.directory / f"g{generation:06d}-e{epoch}-s{start:08d}" / phase / f"r{rt.me.replica}"
        name = write_member_units(path, member, state, rt.specs)
        side = {"rank": hooks.rank, "pid": os.getpid(), "member": list(rt.me), "tp_rank": member.tp_rank,
                "generation": generation, "epoch": epoch, "start": start, "step": state.step,
                "file": name, "global_batch": rt.layout.global_batch,
                "degrees": {str(r.replica): r.degree for r in rt.layout.replicas},
                "local_batches": {str(r.replica): r.local_batch for r in rt.layout.replicas}}
        tmp = path / (name + ".json.tmp")
        tmp.write_text(json.dumps(side))
        os.replace(tmp, path / (name + ".json"))
