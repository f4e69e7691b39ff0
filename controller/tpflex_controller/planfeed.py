"""Plan generations of a job, fanned out from an informer to many streams.

The plans come from an informer (tpflex_proto.informer) as a registered handler: the
process's shared informer of ``/tpflex/v1/`` when the feed is given one (the controller),
or else an informer of the job's own keys, started with the job's first subscription and
stopped with its last. The handler only picks out the plan keys of subscribed jobs and
queues them; the feed's own thread assembles the plans (tpflex_proto.planstore), so that a
large plan never holds up the informer's other handlers (the reconcile loop). Restart
epochs live under ``/tpflex/liveness/v1/``, outside the informer's prefix: one watch of a
subscribed job's liveness key brings them.
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
        self._assembler = planstore.Assembler()
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        if informer is not None:
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
            elif self.informer.synced.is_set():  # else the informer's first batch brings it
                current = [c for c in self.informer.items(keys.job_prefix(job))
                           if c.parsed is not None and c.parsed.kind in _PLAN_KINDS]
                self._work.put((job, folder, current, False))
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
        with self._lock:
            if not self._folders:
                return
            picked: dict[str, list[Change]] = {}
            for c in batch.changes:
                pk = c.parsed
                if pk is not None and pk.kind in _PLAN_KINDS and pk.name in self._folders:
                    picked.setdefault(pk.name, []).append(c)
            for job, changes in picked.items():
                self._work.put((job, self._folders[job], changes, True))

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
