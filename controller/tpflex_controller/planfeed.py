"""Plan generations of a job, fanned out from an informer to many streams.

The plans come from an informer (tpflex_proto.informer) as a registered handler: the
process's shared informer of ``/tpflex/v1/`` when the feed is given one (the controller),
or else an informer of the job's own keys, started with the job's first subscription and
stopped with its last. The handler only picks out the plan keys of subscribed jobs and
queues them; the feed's own thread assembles the plans (tpflex_proto.planstore), so that a
large plan never holds up the informer's other handlers (the reconcile loop). Restart
epochs live under ``/tpflex/liveness/v1/``, outside the informer's prefix: one watch of a
subscribed job's liveness key brings them.

With a shared informer the feed keeps, for every job, the keys of its current plan (the
header and the parts it and any newer staged generation use; ``planstore.PartIndex
.release``) as the batches pass: a new subscription starts from those, so the informer
need not hold plan keys at all (the controller's keeps neither parts nor history: a second
copy of every kept generation's parts, which grew with the history).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading

from tpflex_proto import codec, keys, planstore, types_pb2
from tpflex_proto.etcd import Etcd, Watch, WatchEvent
from tpflex_proto.informer import Batch, Change, Informer
from tpflex_proto.keys import Kind

log = logging.getLogger(__name__)

_PLAN_KINDS = frozenset({Kind.JOB_PLAN, Kind.JOB_ASSIGN})


class Subscription:
    def __init__(self, job: str) -> None:
        self.job = job
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = threading.Event()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self) -> None:
        self._closed.set()
        self._q.put(None)

    def offer(self, plan: types_pb2.Plan | types_pb2.Liveness) -> None:
        self._q.put(plan)

    def get(self, timeout: float) -> types_pb2.Plan | types_pb2.Liveness | None:
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            return None


class PlanFeed:
    """``subscribe(job)`` before reading the current plan: every generation committed after
    the subscription is offered to it (the informer resumes across outages and re-lists
    after a compaction). A plan may be offered more than once, and the current one at the
    subscription may be offered too: streams keep only what is newer than they sent."""

    def __init__(self, etcd: Etcd, informer: Informer | None = None) -> None:
        self.etcd = etcd
        self.informer = informer
        self._lock = threading.Lock()
        self._subs: dict[str, set[Subscription]] = {}
        self._folders: dict[str, planstore.JobPlans] = {}  # per subscribed job
        self._own: dict[str, tuple[Informer, object]] = {}  # without a shared informer
        self._live_watches: dict[str, Watch] = {}
        # with a shared informer: every job's current plan keys (header, parts by (gen, pos))
        self._current: dict[str, tuple[list[Change | None], planstore.PartIndex]] = {}
        self._assembler = planstore.Assembler()
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        if informer is not None:
            if informer.synced.is_set() and informer.keep is not None and not _PLAN_KINDS <= informer.keep:
                raise ValueError("a plan feed registers before the informer syncs, or the informer keeps plan keys")
            informer.add_handler(self._on_batch)

    def subscribe(self, job: str) -> Subscription:
        sub = Subscription(job)
        with self._lock:
            self._subs.setdefault(job, set()).add(sub)
            if self._worker is None:
                self._worker = threading.Thread(target=self._fold_loop, name="plan-feed", daemon=True)
                self._worker.start()
            if job not in self._live_watches:
                _, rev = self.etcd.get_prefix(keys.liveness(job))
                self._live_watches[job] = self.etcd.watch_prefix(
                    keys.liveness(job), lambda evs, j=job: self._deliver_liveness(j, evs),
                    start_revision=rev + 1,
                )
        # the job's current plan keys, and from then on the informer's batches, with no
        # batch in between: none is delivered while the informer's lock is held
        with self.informer.locked() if self.informer is not None else contextlib.nullcontext(), self._lock:
            if job in self._folders:
                return sub
            folder = self._folders[job] = planstore.JobPlans(job, self._assembler)
            if self.informer is None:
                own = Informer(self.etcd, keys.job_prefix(job))
                self._own[job] = (own, own.add_handler(self._on_batch))
                own.start()  # its first batch (once listed) is the job's current state
            elif job in self._current:  # else the informer's batches bring it
                self._work.put((job, folder, self._current_keys(job), False))
        return sub

    def history(self, job: str) -> list[types_pb2.Plan]:
        """The job's kept plan generations (``jobs/<job>/history/``), oldest first; a
        malformed or incomplete one skips them all with a log line."""
        try:
            return planstore.read_job(self.etcd, job)[1]
        except codec.MalformedValue as exc:
            log.warning("skipping malformed etcd value key=%s error=%s", exc.key, exc)
            return []

    def unsubscribe(self, sub: Subscription) -> None:
        own = live = None
        with self._lock:
            subs = self._subs.get(sub.job)
            if subs is None:
                return
            subs.discard(sub)
            if subs:
                return
            del self._subs[sub.job]
            self._folders.pop(sub.job, None)
            own = self._own.pop(sub.job, None)
            live = self._live_watches.pop(sub.job, None)
        if live is not None:
            live.cancel()
        if own is not None:
            informer, unregister = own
            unregister()
            informer.stop()

    def watched_jobs(self) -> list[str]:
        """The jobs with at least one subscription."""
        with self._lock:
            return sorted(self._folders)

    # ---- the informer's thread: pick, queue ----

    def _on_batch(self, batch: Batch) -> None:
        shared = self.informer is not None
        with self._lock:
            if not self._folders and not shared:
                return
            picked: dict[str, list[Change]] = {}
            for c in batch.changes:
                pk = c.parsed
                if pk is None or pk.kind not in _PLAN_KINDS:
                    continue
                if shared:
                    self._keep_current(pk, c)
                if pk.name in self._folders:
                    picked.setdefault(pk.name, []).append(c)
            for job, changes in picked.items():
                self._work.put((job, self._folders[job], changes, True))

    def _keep_current(self, pk: keys.Key, c: Change) -> None:
        """Under ``_lock``, on the informer's thread: fold a plan key of any job into the
        current plan keys kept for new subscriptions."""
        if c.deleted:
            kept = self._current.get(pk.name)
            if kept is None:
                return
            if pk.kind is Kind.JOB_ASSIGN:
                kept[1].remove(pk.number, pk.position)
            else:
                kept[0][0] = None  # a deleted plan: its parts go (or went) with it
            if kept[0][0] is None and not kept[1].values:
                del self._current[pk.name]
            return
        header, parts = self._current.setdefault(pk.name, ([None], planstore.PartIndex()))
        if pk.kind is Kind.JOB_ASSIGN:
            parts.add(pk.number, pk.position, c)
        else:
            header[0] = c
            try:
                generation = planstore.decode_plan(c.value, c.key).generation
            except codec.MalformedValue:
                return  # the feed's thread logs it when a subscription folds it
            parts.release(generation)

    def _current_keys(self, job: str) -> list[Change]:
        """Under ``_lock``: the job's kept plan keys, parts (key order) before the header."""
        header, parts = self._current[job]
        out = [parts.values[gp] for gp in sorted(parts.values)]
        return out + [header[0]] if header[0] is not None else out

    # ---- the feed's thread: assemble, offer ----

    def _fold_loop(self) -> None:
        while True:
            job, folder, changes, offer = self._work.get()
            plans = []
            for c in changes:
                try:
                    plan = folder.fold(c.key, c.value, c.deleted)
                except codec.MalformedValue as exc:
                    log.warning("skipping malformed etcd value key=%s error=%s", c.key, exc)
                    continue
                if plan is not None:
                    plans.append(plan)
            with self._lock:
                if self._folders.get(job) is not folder or not offer:
                    continue  # unsubscribed since (a later subscription has its own folder)
                subs = list(self._subs.get(job, ()))
            for sub in subs:
                for plan in plans:
                    sub.offer(plan)

    def _deliver_liveness(self, job: str, events: list[WatchEvent]) -> None:
        """A new restart epoch of the job (``types.Liveness``) is offered to its streams."""
        records = []
        for ev in events:
            if ev.key != keys.liveness(job) or ev.kind != "put":
                continue
            try:
                records.append(codec.decode(types_pb2.Liveness, ev.value))
            except codec.MalformedValue as exc:
                log.warning("skipping malformed etcd value key=%s error=%s", ev.key, exc)
        with self._lock:
            subs = list(self._subs.get(job, ())) if records else []
        for sub in subs:
            for record in records:
                sub.offer(record)
