"""Reading the whole controller state into a fresh :class:`ClusterView` (start-up, leader
take-over, resync after compaction). Plan history headers are skipped (the parts the kept
generations share are read with the current plan), so a re-read costs O(current state)."""

from __future__ import annotations

from tpflex_proto import keys
from tpflex_proto.etcd import Etcd

from tpflex_controller.cache import ClusterView

# sub-trees read whole (values); events are read as key names only
_VALUE_PREFIXES = (keys.RACKS, keys.NODES, keys.HEALTH, keys.OVERRIDES, keys.POWER)


def load_view(
    etcd: Etcd, event_log_size: int = 1000, default_policy: str = "ntp-pw"
) -> tuple[ClusterView, int]:
    """A view of everything under ``/tpflex/v1/``; returns it and the revision of the first
    read (a watch started after it replays anything newer; folding is idempotent)."""
    view = ClusterView(event_log_size, default_policy)
    first_rev = 0
    for prefix in _VALUE_PREFIXES:
        kvs, rev = etcd.get_prefix(prefix)
        first_rev = first_rev or rev
        for kv in kvs:
            view.fold("put", kv.key, kv.value, kv.mod_revision)
    events, _ = etcd.get_prefix(keys.EVENTS, keys_only=True)
    for kv in events:
        view.fold("put", kv.key, b"", kv.mod_revision)
    job_keys, _ = etcd.get_prefix(keys.JOBS, keys_only=True)
    jobs = sorted({k.name for kv in job_keys if (k := keys.parse(kv.key)) is not None})
    for job in jobs:
        # one read per job: its plan's parts sort before its header (planstore)
        kvs, _ = etcd.get_prefix(keys.job_prefix(job))
        for kv in kvs:
            if not kv.key.startswith(keys.job_plan_histories(job)):
                view.fold("put", kv.key, kv.value, kv.mod_revision)
    return view, first_rev
