"""The leader's flap damping as shared state: one ``/tpflex/v1/holds/<node>/<index>`` key
per GPU the damper counts as failed (damping.py), so that the REST API (GET /v1/gpus,
dry-run: ``convert.cluster_state`` counts a held GPU as failed) and the next leader
(``adopt``) see the same hold-downs as the leader's planner.

A hold is written when the GPU fails (``until`` 0: its hold-down starts at the recovery),
rewritten with ``until`` when it recovers, and deleted when the hold-down ends: the keys
are bounded by the GPUs failed or held now. Writes are fenced like every leader write and
batched: one transaction per loop pass that changed holds, after the pass's plan commits
(they are not on a failure's path to its commit).

Times: the damper runs on a monotonic clock, a stored ``until`` is wall-clock seconds; the
conversion is the only place that mixes them.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.etcd import Op

from tpflex_controller.damping import FlapDamper, Hold, Phase

log = logging.getLogger(__name__)


def to_record(gpu: tuple[str, int], hold: Hold, mono_now: float, wall_now: float) -> types_pb2.GpuHold:
    """The stored form of ``hold`` (pure)."""
    node, index = gpu
    rec = types_pb2.GpuHold(gpu=types_pb2.GpuRef(node=node, index=index), failures=hold.failures,
                            since=wall_now)
    if hold.phase is Phase.HELD:
        rec.until = wall_now + max(0.0, hold.release_at - mono_now)
        rec.reason = (f"flap hold-down: healthy again, counted as failed until the hold-down ends"
                      f" ({hold.failures} recent failure(s))")
    else:
        rec.reason = f"failed; a flap hold-down follows its recovery ({hold.failures} recent failure(s))"
    return rec


def from_record(rec: types_pb2.GpuHold, mono_now: float, wall_now: float) -> Hold:
    """The damper's form of a stored hold (pure)."""
    if rec.until > 0:
        return Hold(Phase.HELD, mono_now + (rec.until - wall_now), rec.failures)
    return Hold(Phase.DOWN, 0.0, rec.failures)


def changes(want: dict[Hashable, Hold], stored: dict[Hashable, Hold]) -> tuple[dict[Hashable, Hold], list[Hashable]]:
    """The holds to (re)write and the GPUs whose hold to delete (pure)."""
    puts = {gpu: h for gpu, h in want.items() if stored.get(gpu) != h}
    return puts, [gpu for gpu in stored if gpu not in want]


class HoldMirror:
    """Keeps the hold keys equal to the leader's damper (used by the reconcile thread)."""

    def __init__(self, damper: FlapDamper) -> None:
        self.damper = damper
        self._stored: dict[Hashable, Hold] = {}  # what etcd has, as this process knows

    def adopt(self, records: dict[tuple[str, int], types_pb2.GpuHold], mono_now: float, wall_now: float) -> None:
        """On election: take the stored holds over (the view re-folds the damped GPUs
        afterwards, ``ClusterView.attach_damper``)."""
        holds = {gpu: from_record(rec, mono_now, wall_now) for gpu, rec in records.items()}
        adopted = self.damper.adopt(holds, mono_now)
        # a stored hold the damper did not take (damping off) is deleted by the next sync
        self._stored = {gpu: adopted.get(gpu, Hold(Phase.UP)) for gpu in records}

    def sync(self, session, mono_now: float, wall_now: float) -> tuple[list, int] | None:
        """Write what changed since the last sync in one fenced transaction; returns the
        folded form ``[(kind, key, value)]`` and its revision, or None when nothing
        changed. Raises what ``session.txn`` raises (NotLeader, EtcdError)."""
        want = self.damper.holds(mono_now)
        puts, deletes = changes(want, self._stored)
        if not puts and not deletes:
            return None
        ops, folded = [], []
        for gpu, hold in puts.items():
            key, value = keys.gpu_hold(*gpu), codec.encode(to_record(gpu, hold, mono_now, wall_now))
            ops.append(Op.put(key, value))
            folded.append(("put", key, value))
        for gpu in deletes:
            ops.append(Op.delete(keys.gpu_hold(*gpu)))
            folded.append(("delete", keys.gpu_hold(*gpu), b""))
        res = session.txn((), ops)
        for gpu in deletes:
            del self._stored[gpu]
        self._stored.update(puts)
        log.info("flap holds stored written=%d deleted=%d", len(puts), len(deletes))
        return folded, res.revision
