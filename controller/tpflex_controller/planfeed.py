"""Plan generations of a job, fanned out from one shared etcd watch to many streams."""

from __future__ import annotations

import logging
import queue
import threading

from tpflex_proto import codec, keys, planstore, types_pb2
from tpflex_proto.etcd import Etcd, Watch, WatchEvent

log = logging.getLogger(__name__)


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

    def offer(self, plan: types_pb2.Plan) -> None:
        self._q.put(plan)

    def get(self, timeout: float) -> types_pb2.Plan | None:
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            return None


class PlanFeed:
    """``subscribe(job)`` before reading the current plan: every generation committed after
    the subscription is offered to it (the etcd watch resumes across outages)."""

    def __init__(self, etcd: Etcd) -> None:
        self.etcd = etcd
        self._lock = threading.Lock()
        self._subs: dict[str, set[Subscription]] = {}
        self._watches: dict[str, Watch] = {}
        self._live_watches: dict[str, Watch] = {}
        self._plans: dict[str, planstore.JobPlans] = {}  # per watched job (planstore)
        self._assembler = planstore.Assembler()

    def subscribe(self, job: str) -> Subscription:
        sub = Subscription(job)
        with self._lock:
            self._subs.setdefault(job, set()).add(sub)
            if job not in self._watches:
                kvs, rev = self.etcd.get_prefix(keys.job_assigns(job))
                self._plans[job] = planstore.JobPlans(job, self._assembler)
                self._plans[job].fold_read(kvs)
                self._watches[job] = self.etcd.watch_prefix(
                    keys.job_prefix(job), lambda evs, j=job: self._deliver(j, evs), start_revision=rev + 1
                )
                _, rev = self.etcd.get_prefix(keys.liveness(job))
                self._live_watches[job] = self.etcd.watch_prefix(
                    keys.liveness(job), lambda evs, j=job: self._deliver_liveness(j, evs),
                    start_revision=rev + 1,
                )
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
        watch = None
        with self._lock:
            subs = self._subs.get(sub.job)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[sub.job]
                    watch = self._watches.pop(sub.job, None)
                    live = self._live_watches.pop(sub.job, None)
                    if live is not None:
                        live.cancel()
                    self._plans.pop(sub.job, None)
        if watch is not None:
            watch.cancel()

    def _deliver(self, job: str, events: list[WatchEvent]) -> None:
        plans = []
        with self._lock:
            folder = self._plans.get(job)
            subs = list(self._subs.get(job, ()))
        if folder is None:
            return
        for ev in events:  # one thread per watch: the folder is only touched here
            try:
                plan = folder.fold(ev.key, ev.value, ev.kind == "delete")
            except codec.MalformedValue as exc:
                log.warning("skipping malformed etcd value key=%s error=%s", ev.key, exc)
                continue
            if plan is not None:
                plans.append(plan)
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
