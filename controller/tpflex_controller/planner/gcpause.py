"""The planner's entry points run with Python's cyclic garbage collector paused.

A cold plan of 262,144 GPUs allocates a few hundred thousand objects that nearly all
survive the call (they are the plan), so the young-generation collections those
allocations trigger only scan objects that are not garbage: about 10% of a cold plan's
instructions under callgrind, and 20-30% of its wall time in bench/controller_scale.py
(``full_replan_ms`` with the collector on vs paused). Reference counting still frees every
acyclic temporary at once; a cycle made during a plan (the planner makes none on purpose)
waits for the first collection after it.

The pause nests, and a call re-enables the collector only if it was the one that paused
it: a caller that disabled the collector itself keeps it disabled.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def gc_paused(fn: Callable[P, R]) -> Callable[P, R]:
    @functools.wraps(fn)
    def paused(*args: P.args, **kwargs: P.kwargs) -> R:
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return paused
