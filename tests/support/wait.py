"""Polling an external process's state with a deadline (no sleeps as synchronisation
where an event can be awaited: this is for state only visible by asking)."""

from __future__ import annotations

import time


def wait_until(cond, timeout: float, what: str, interval: float = 0.02, *, fail=None):
    """Poll ``cond`` until it returns something truthy (returned) or the deadline; then
    raise ``fail()`` if given (a caller's own exception), else an AssertionError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    if fail is not None:
        raise fail()
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
