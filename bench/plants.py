"""Planted defects for the benches' own accounting checks: ``TPFLEX_BENCH_PLANT`` names a
defect a bench plants on purpose, so that its check can be seen failing (and the same
command without the variable is the bench as shipped)."""

from __future__ import annotations

import os

ENV = "TPFLEX_BENCH_PLANT"


def planted(bench: str, plants: tuple[str, ...], env: dict | None = None) -> str | None:
    """The defect ``TPFLEX_BENCH_PLANT`` asks ``bench`` to plant (None: none); one the bench
    does not know is an error, not a silent no-op."""
    value = (os.environ if env is None else env).get(ENV, "")
    if not value:
        return None
    if value not in plants:
        raise ValueError(f"{ENV}={value!r}: {bench} plants one of {', '.join(plants)}")
    return value
