"""The reconcile loop's record of a job that must be looked at again (pure data), and
when a burst of operator overrides is planned (a pure function of the clock)."""

from __future__ import annotations

from dataclasses import dataclass

# operator changes: a burst of them (a drain/undrain storm) is planned once, when it stops
OPERATOR_CAUSES = frozenset({"drain", "undrain", "power_pin", "override"})


@dataclass
class DirtyJob:
    cause: str
    detected_at: float  # wall clock when the change was seen
    revision: int = 0  # etcd revision of the latest change that marked it
    not_before: float = 0.0  # monotonic; retry backoff, or the end of an operator burst
    attempts: int = 0
    first_seen: float = 0.0  # monotonic
    urgent: bool = True  # marked by something else than operator overrides


def coalesce_until(d: DirtyJob, now: float, quiet_s: float) -> float:
    """When a job marked only by operator overrides is planned: ``quiet_s`` after the
    latest one, but no later than ``8 x quiet_s`` after the first (pure)."""
    if d.urgent or quiet_s <= 0:
        return d.not_before
    return max(d.not_before, min(now + quiet_s, d.first_seen + 8 * quiet_s))
