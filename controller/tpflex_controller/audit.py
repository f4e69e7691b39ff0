"""The audit trail: one structured line per mutating REST call and per refused
trainer-plane call, on the dedicated logger ``tpflex.audit`` (docs/api.md, "Audit log":
route it to the site's log system with its own handler).

Each record is one JSON object: ``ts`` (Unix seconds), ``who`` (the caller: a named
operator token, ``job:<job>/<credential>`` for a trainer, ``anonymous``), ``what`` (the
operation: ``POST /v1/nodes/{node}/gpus/{index}/drain``, ``trainer.AckPlan``), ``target``
(what it acted on), ``outcome`` (``ok``, ``denied``, ``invalid``, ``error``) and
``request_id``; optional ``reason``, ``status``, ``peer``.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

log = logging.getLogger("tpflex.audit")


def request_id() -> str:
    """A fresh request id (callers without one of their own)."""
    return uuid.uuid4().hex[:16]


def _clean(value: object, limit: int = 256) -> object:
    if isinstance(value, str):
        return value[:limit]
    return value


def record(*, who: str, what: str, target: str, outcome: str, request_id: str = "",
           **extra: object) -> dict:
    """Write one audit line and return it (as a dict). Never raises for its input."""
    entry = {"ts": round(time.time(), 3), "who": _clean(who), "what": _clean(what),
             "target": _clean(target), "outcome": outcome, "request_id": _clean(request_id)}
    entry.update({k: _clean(v) for k, v in extra.items() if v not in (None, "")})
    try:
        log.info("%s", json.dumps(entry, sort_keys=True, default=str))
    except Exception:  # a broken handler must not fail the call it records
        pass
    return entry
