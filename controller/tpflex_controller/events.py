"""The bounded event log (``events/<seq>``), written by the leader through its fenced
session: a new record deletes the oldest beyond the bound in the same transaction; phase
updates rewrite a decision's record in place."""

from __future__ import annotations

import logging

from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.etcd import EtcdError, Op

from tpflex_controller.cache import ClusterView
from tpflex_controller.election import LeaderSession, NotLeader
from tpflex_controller.rollout import Rollout, event_phases

log = logging.getLogger(__name__)


def append_event(session: LeaderSession, view: ClusterView, event: types_pb2.Event) -> None:
    """Store ``event`` under the next sequence number (set on it), trimming the oldest."""
    event.seq = view.next_event_seq()
    ops = [Op.put(keys.event(event.seq), codec.encode(event))]
    seqs = view.event_seqs
    trim = seqs[0] if len(seqs) >= view.event_log_size else 0
    if trim:
        ops.append(Op.delete(keys.event(trim)))
    session.txn(success=ops)
    if trim:
        seqs.popleft()
    seqs.append(event.seq)


def store_phases(session: LeaderSession | None, view: ClusterView, unwritten: dict[int, Rollout]) -> None:
    """Rewrite the records of decisions that reached new phases; stops at the first error
    (what is left is retried on the next flush)."""
    while unwritten and session is not None and session.active:
        seq, r = next(iter(unwritten.items()))
        if seq not in view.event_seqs:
            del unwritten[seq]  # trimmed from the bounded log meanwhile
            continue
        del r.event.phases[:]
        r.event.phases.extend(event_phases(r))
        try:
            session.put(keys.event(seq), codec.encode(r.event))
        except (NotLeader, EtcdError) as exc:
            log.warning("event update failed job=%s seq=%d error=%s", r.job, seq, exc)
            return
        del unwritten[seq]
