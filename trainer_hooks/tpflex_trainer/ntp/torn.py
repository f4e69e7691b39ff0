"""Torn steps: a rank died inside a step's last collective, so some members applied the
step's optimizer update and others did not.

Each member keeps a copy of its units' state from before its latest optimizer update (the
*undo* state: weights, Adam moments, step) until a collective of the next step shows that
every member got past that update (``NtpRuntime.confirm_step``; the trainer hooks call it
after the step boundary's all-reduce). When the agreement finds members one step apart and
some unit's newest copy gone with the dead rank, the members ahead go back to their undo
state, so every unit is at the older step and that step is replayed: the same data (the
batch is a function of the step), the same learning rate and Adam step count (both come
from the state's step). Nothing else carries over a step (no gradient scaler: bf16 runs
keep fp32 master weights and unscaled gradients).

Memory: the undo state is one copy of the member's local state (3 floats per parameter
element). With the hooks it lives only from the optimizer update to the next step's first
collective, so it is freed before the next forward/backward allocates activations.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from tpflex_trainer.ntp import collectives
from tpflex_trainer.ntp.layout import Member
from tpflex_trainer.ntp.state import LocalState

log = logging.getLogger(__name__)

# Test hook: "<step>:exit" ends this process, "<step>:fail" raises as a failed collective
# would, after the step's last collective and before its optimizer update (a torn step).
# Unset in real runs.
FAULT_ENV = "TPFLEX_TEST_FAULT_BEFORE_UPDATE"
_ACTIONS = ("exit", "fail")


class InjectedFault(RuntimeError):
    """The test hook's stand-in for a collective that failed because a peer died."""


def parse_fault(value: str | None) -> tuple[int, str] | None:
    if not value:
        return None
    step, _, action = value.partition(":")
    if not step.isdigit() or action not in _ACTIONS:
        raise ValueError(f"{FAULT_ENV} must be '<step>:exit' or '<step>:fail', got {value!r}")
    return int(step), action


class FaultHook:
    """The test hook of one process: fires once, at the given step, before the update."""

    def __init__(self, value: str | None) -> None:
        self.fault = parse_fault(value)

    def before_update(self, step: int) -> None:
        if self.fault is None or self.fault[0] != step:
            return
        action, self.fault = self.fault[1], None  # a replay of the step runs clean
        if action == "exit":
            log.warning("test fault: process exits before the optimizer update step=%d", step)
            collectives.flush_sends()  # dies after the step's last collective reached every peer
            os._exit(1)  # a rank gone inside the step: no goodbye to the peers
        raise InjectedFault(f"test fault: the last collective of step {step} failed before the optimizer update")


def copy_state(state: LocalState) -> LocalState:
    """A copy of ``state`` (units, every tensor, step) that later updates do not touch."""
    tensors = {kind: {name: t.clone() for name, t in ts.items()} for kind, ts in state.tensors.items()}
    return LocalState(dict(state.units), tensors, state.step)


def rollback_step(reports: Mapping[Member, tuple[int, int | None]]) -> int | None:
    """``reports``: member -> (step, undo step or None) of every member holding state. The
    older step of a torn step (members at two consecutive steps) when every member at the
    newer one can undo its update back to it; else None. Pure."""
    steps = sorted({step for step, _ in reports.values()})
    if len(steps) != 2 or steps[1] != steps[0] + 1:
        return None
    older, newest = steps
    if all(undo == older for step, undo in reports.values() if step == newest):
        return older
    return None
