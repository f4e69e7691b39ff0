"""Nonuniform tensor parallelism (NTP) runtime: unit layouts across TP degrees, a
unit-sharded GPT, minimal-traffic resharding with peer recovery, gradient sync across
degrees and layout-independent checkpoints. See docs/ntp.md.

Pure modules (``layout``, ``reshard_plan``, ``config``, ``plan_adapter``, ``errors``) do
not import torch; the names below are loaded lazily so importing them stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "NtpRuntime": "runtime",
    "ReshardReport": "runtime",
    "AdamSettings": "optim",
    "GPTConfig": "config",
    "Member": "layout",
    "ReplicaPlacement": "layout",
    "JobLayout": "layout",
    "plan_layout": "layout",
    "plan_reshard": "reshard_plan",
    "placements_from_plan": "plan_adapter",
    "CheckpointReader": "checkpoint",
    "NtpError": "errors",
    "ConfigError": "errors",
    "LayoutError": "errors",
    "PlanError": "errors",
    "UnitsUnavailableError": "errors",
    "CheckpointError": "errors",
    "CheckpointMismatchError": "errors",
    "reference_losses": "reference",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
