"""The reconcile loop: watch ``/tpflex/v1/``, re-plan dirty jobs, commit, roll out.

Level-triggered (controller-runtime style): the process's shared informer
(tpflex_proto.informer) hands every change to this loop, which folds it into the
:class:`~tpflex_controller.cache.ClusterView` and marks job *identities* dirty; the loop
re-reads the view, calls the pure planner, and commits a new generation only when the
decision changed. Every replica keeps its view warm; only the elected leader plans and
writes (through its fenced :class:`~tpflex_controller.election.LeaderSession`). One thread
owns the view; the informer, the elector and the agent pusher talk to it through its inbox.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading

import grpc
from tpflex_proto import keys, types_pb2
from tpflex_proto.etcd import Etcd, EtcdError
from tpflex_proto.informer import Batch, Change, Informer
from tpflex_proto.keys import Kind
from tpflex_proto.tls import ClientCertificateFiles

from tpflex_controller import convert
from tpflex_controller.agent_client import AgentPusher, PushResult
from tpflex_controller.cache import ClusterView, NodePower
from tpflex_controller.clock import SYSTEM_CLOCK, Clock
from tpflex_controller.damping import FlapDamper
from tpflex_controller.election import Conflict, LeaderSession, NotLeader
from tpflex_controller.events import append_event, store_phases
from tpflex_controller.holds import HoldMirror
from tpflex_controller.metrics import ControllerMetrics
from tpflex_controller.planbytes import PlanEncoder
from tpflex_controller.planner.gcpause import gc_paused
from tpflex_controller.planner.incremental import JobPlan, replan
from tpflex_controller.planner.model import PlanningError, PlanResult, release_evicted
from tpflex_controller.planning import (
    Planned,
    build_commit,
    build_retire,
    changed_degrees,
    commit_plan,
    commit_retire,
    pin_events,
    rank_count,
    rank_count_since,
)
from tpflex_controller.rollout import Phase, Rollout, RolloutTracker
from tpflex_controller.workqueue import OPERATOR_CAUSES, Action, DirtyJob, Result, WorkQueue

log = logging.getLogger(__name__)


MAX_OPERATOR_NOTES = 16  # operator changes named per decision (a burst of drains)


class Reconciler:
    def __init__(
        self,
        etcd: Etcd,
        metrics: ControllerMetrics,
        *,
        event_log_size: int = 1000,
        history_size: int = 100,
        agent_timeout: float = 2.0,
        agent_credentials: grpc.ChannelCredentials | ClientCertificateFiles | None = None,
        default_policy: str = "ntp-pw",
        clock: Clock = SYSTEM_CLOCK,
        flap_hold_down_s: float = 0.0,
        override_coalesce_s: float = 0.0,
        informer: Informer | None = None,
    ) -> None:
        self.etcd = etcd
        # the process's informer; without one, the reconciler runs (and stops) its own
        self._own_informer = informer is None
        self.informer = informer if informer is not None else Informer(etcd)
        self._unregister = None
        self.metrics = metrics
        self._job_plans: dict[str, JobPlan] = {}  # the last plan of each job (incremental)
        self._event_log_size = event_log_size
        self._history_size = history_size
        self._clock = clock  # the loop reads time from nothing else (clock.py)
        self._default_policy = default_policy
        self.view = ClusterView(event_log_size, default_policy)
        self._damper = FlapDamper(flap_hold_down_s)
        self.view.attach_damper(self._damper, clock.mono)
        self._holds = HoldMirror(self._damper)  # the damping in etcd, for REST and the next leader
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._session: LeaderSession | None = None
        self._queue = WorkQueue(override_coalesce_s)
        self._conflict_nodes: dict[str, list[str]] = {}  # power keys of a lost CAS
        self._unplannable: dict[str, str] = {}
        # job -> the operators' changes (name, note) folded since its last decision: the
        # next plan and event carry who (Plan.by, Event.by) and what (a reason line)
        self._operators: dict[str, list[tuple[str, str]]] = {}
        self._rollouts = RolloutTracker()
        self._need_load = True  # until the informer's initial state is folded
        self._stop = threading.Event()
        self.ready = threading.Event()  # the view has been loaded once
        self.pusher = AgentPusher(
            lambda r: self._inbox.put(("push", r, clock.wall())),
            timeout=agent_timeout,
            on_failure=metrics.agent_push_failures.inc,
            credentials=agent_credentials,
            clock=clock,
        )
        self._encoder = PlanEncoder()
        self._unwritten: dict[int, Rollout] = {}  # event records with phases not yet stored
        self._freeze_after_pass = False
        self._froze = False  # whether this loop moved the heap to the permanent generation
        self._to_warm: set[str] = set()  # jobs whose new plan's cap index may not be built
        self._repush_after_load = False
        # etcd revisions of this process's plan commits: their echo through the watch is
        # folded already (ClusterView.record_commit) and skipped
        self._own_revs: set[int] = set()
        self._power_seen: dict[str, NodePower] = {}  # gauges set when idle
        self._racks_seen: set[str] = set()  # racks whose healthy-GPU gauge is due (when idle)
        self._acks_due: set[str] = set()  # jobs whose acked-generation gauge is due (when idle)
        self._plan_ranks: dict[str, tuple[int, int]] = {}  # job -> (plan generation, its ranks)
        self._ranks: dict[str, tuple[PlanResult, int]] = {}  # job -> its last plan's ranks
        self._thread = threading.Thread(target=self._run, name="reconcile", daemon=True)

    # ---- thread-safe entry points ----

    def start(self) -> None:
        self._thread.start()
        self._unregister = self.informer.add_handler(
            lambda batch: self._inbox.put(("informer", batch, self._clock.wall()))
        )
        if self._own_informer:
            self.informer.start()

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(("stop", None, 0.0))
        if self._thread.ident is not None:
            self._thread.join(timeout=10)
        self._session = None
        self.metrics.is_leader.set(0)
        if self._unregister is not None:
            self._unregister()
        if self._own_informer:
            self.informer.stop()
        self.pusher.close()
        if self._froze:
            # hand what the loop froze back to the collector: a process that stops a
            # controller and goes on (an embedding, a test) would otherwise keep its
            # cyclic garbage (the loop, its view, its last plans) for good, since the
            # collector never scans the permanent generation
            self._froze = False
            gc.unfreeze()

    def on_elected(self, session: LeaderSession) -> None:
        self._inbox.put(("elected", session, self._clock.wall()))

    def on_deposed(self, why: str) -> None:
        self._inbox.put(("deposed", why, self._clock.wall()))

    # ---- the loop ----

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(self._wait_time())
            self._release_held()
            if self._leading():
                self._process_queue()
                self._store_holds()
                if self._inbox.empty():
                    self._flush_events()
            if self._power_seen and self._inbox.empty():
                self._flush_power_metrics()
            if self._racks_seen and self._inbox.empty():
                self._flush_rack_metrics()
            if self._acks_due and self._inbox.empty():
                self._flush_ack_metrics()
            if self._inbox.empty():
                self._idle_work()
            if self._freeze_after_pass and not len(self._queue):
                self._freeze_after_pass = False
                self._froze = True
                gc.freeze()  # the long-lived state (view, memoised plans) leaves the GC's scans

    def _drain(self, timeout: float) -> None:
        try:
            msg = self._inbox.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            try:
                self._handle(*msg)
            except Exception:
                log.exception("controller message handling failed kind=%s", msg[0])
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _wait_time(self) -> float:
        release = self._damper.next_release()
        wait = 1.0 if release is None else max(0.0, min(1.0, release - self._clock.mono()))
        soonest = self._queue.next_due()
        if soonest is None or not self._leading():
            return wait
        return max(0.0, min(wait, soonest - self._clock.mono()))

    def _release_held(self) -> None:
        """GPUs whose flap hold-down ended are plannable again (damping.py)."""
        at = self._clock.wall()
        for job, cause in self.view.release_held():
            self._mark(job, cause, at)

    def _adopt_holds(self) -> None:
        """A new leader takes the stored flap holds over (holds.py); the view counts them."""
        self._holds.adopt(self.view.snap.gpu_holds, self._clock.mono(), self._clock.wall())
        self.view.attach_damper(self._damper, self._clock.mono)

    def _store_holds(self) -> None:
        """Mirror the damper's holds into etcd (holds.py); a failed write is retried on
        the next pass (NotLeader ends the session: the next leader adopts what is stored)."""
        try:
            done = self._holds.sync(self._session, self._clock.mono(), self._clock.wall())
        except (NotLeader, EtcdError) as exc:
            log.warning("flap holds not stored error=%s", exc)
            return
        for kind, key, value in done[0] if done else ():
            self.view.fold(kind, key, value, done[1])

    def _leading(self) -> bool:
        s = self._session
        return s is not None and s.active and not self._need_load

    def _load(self, batch: Batch) -> None:
        """A fresh view of the informer's whole state (its first batch to this loop)."""
        view = ClusterView(self._event_log_size, self._default_policy)
        for c in batch.changes:
            if c.parsed is not None and c.parsed.kind is not Kind.JOB_HISTORY:
                view.fold_change(c)
        view.attach_damper(self._damper, self._clock.mono)  # held GPUs stay held across re-reads
        rev = batch.revision
        self.view, self._need_load = view, False
        if self._session is not None:  # elected before the state was read
            self._adopt_holds()
        self._job_plans.clear()  # a fresh view: every job is planned whole once
        now = self._clock.wall()
        for job, spec in view.snap.jobs.items():
            self.metrics.job_seen(job, len(spec.replicas))
            self._mark(job, "resync", now)
        for job, rec in view.plans.items():
            if rec.proto is not None:
                self.metrics.plan_proto_observed(job, rec.proto)
        self._acks_due.update(view.plans)
        self._plan_ranks.clear()
        for node, (power, _) in view.power.items():
            self.metrics.power_observed(node, power.caps)
        for rack, info in view.racks.items():
            self.metrics.rack_observed(rack, view.healthy_gpus(rack), info.domain_size)
        self.ready.set()
        self._freeze_after_pass = True
        log.info("controller state loaded revision=%d jobs=%d racks=%d", rev, len(view.snap.jobs), len(view.racks))

    # ---- messages ----

    def _handle(self, kind: str, payload, at: float) -> None:
        if kind == "informer":
            self._on_batch(payload, at)
        elif kind == "push":
            self._on_push(payload)
        elif kind == "elected":
            self._session = payload
            self.metrics.is_leader.set(1)
            # the watch kept the view current; look at every job again (a stale view only
            # costs a lost compare-and-swap and a re-read) and re-send the desired caps
            self._repush_after_load = True
            if not self._need_load:
                self._adopt_holds()
            for job in self.view.snap.jobs:
                self._mark(job, "resync", at)
        elif kind == "deposed":
            self._session = None
            self.metrics.is_leader.set(0)
            self.pusher.cancel_all()
            self._rollouts.clear()
            # keep what changed and why, as a follower does: whoever leads next (maybe us
            # again) plans it with its real cause (gpu_failed, not resync) and detection time
            self._queue.rearm()
            self._unwritten.clear()
            log.warning("controller stopped acting reason=%s", payload)

    def _on_batch(self, batch: Batch, at: float) -> None:
        if batch.initial:
            self._load(batch)
            return
        if self._need_load:
            return  # the initial batch comes first; nothing to fold into yet
        if batch.resync:  # the differences a re-list found after a compaction
            log.warning("controller folds the re-listed differences revision=%d changes=%d",
                        batch.revision, len(batch.changes))
        acked: dict[str, set[int]] = {}
        own = self._own_revs if not batch.resync else ()
        if own:
            self._own_revs = {r for r in own if r >= batch.revision}
        for ev in batch.changes:
            if ev.mod_revision in own:
                continue  # the echo of our own commit: folded when it was made
            if not self._leading():
                self._forget_handled(ev)
            for job, cause in self.view.fold_change(ev):
                self._mark(job, cause, at, ev.mod_revision)
                if cause in OPERATOR_CAUSES:
                    self._note_operator(job, cause, ev)
            # the changed racks' gauges are set when idle, off the decision's path
            self._after_fold(ev, self._racks_seen, acked)
        for job, ranks in acked.items():
            r = self._rollouts.acks_seen(job, self.view.acks.get(job, {}), ranks, at)
            if r is not None:
                self._phase_reached(r, Phase.ACKED)

    def _after_fold(self, ev: Change, racks: set[str], acked: dict[str, set[int]]) -> None:
        k = ev.parsed
        if k is None:
            return
        kind, name = k.kind, k.name
        if kind in (Kind.HEALTH, Kind.NODE, Kind.GPU_OVERRIDE):
            rack = self.view.node_rack.get(name)
            if rack is not None:
                racks.add(rack)
            if kind is Kind.NODE and ev.kind == "put" and name in self.view.snap.nodes:
                self.pusher.set_address(name, self.view.snap.nodes[name].agent_address)
        elif kind is Kind.RACK:
            racks.add(name)
        elif kind is Kind.POWER and ev.kind == "put":
            rec = self.view.power.get(name)
            if rec is not None:
                self.metrics.power_observed(name, rec[0].caps)
        elif kind is Kind.JOB_ACK:
            acked.setdefault(name, set()).add(k.number)
            self._acks_due.add(name)
        elif kind is Kind.JOB_PLAN and name in self.view.plans and self.view.plans[name].proto is not None:
            self.metrics.plan_proto_observed(name, self.view.plans[name].proto)
            self._acks_due.add(name)
        elif kind is Kind.JOB_SPEC and name in self.view.snap.jobs:
            self.metrics.job_seen(name, len(self.view.snap.jobs[name].replicas))

    def _mark(self, job: str, cause: str, at: float, revision: int = 0) -> None:
        self._queue.mark(job, cause, at, self._clock.mono(), revision)

    def _note_operator(self, job: str, cause: str, ev: Change) -> None:
        """Who made the operator change ``ev`` (its override's ``by``, set by the REST API
        from the caller's token name) and what it was, for ``job``'s next decision. An
        override removed (a full undrain, a cleared override) names nobody."""
        k = ev.parsed
        if k is None:
            return
        if k.kind is Kind.GPU_OVERRIDE:
            o = self.view.snap.gpu_overrides.get((k.name, k.number))
            what = f"{cause} {k.name}:{k.number}"
        elif k.kind is Kind.JOB_OVERRIDE:
            o = self.view.snap.job_overrides.get(k.name)
            what = f"override of job {k.name}"
        else:
            return
        if o is None or not o.by:
            return
        note = f"{what} by {o.by}" + (f": {o.reason}" if o.reason and cause != "power_pin" else "")
        seen = self._operators.setdefault(job, [])
        if len(seen) < MAX_OPERATOR_NOTES and (o.by, note) not in seen:
            seen.append((o.by, note))

    def _operator_fields(self, job: str) -> tuple[str, list[str]]:
        """``by`` (the names, in order, comma-separated) and the notes for ``job``'s next
        decision."""
        seen = self._operators.get(job, ())
        names = list(dict.fromkeys(by for by, _ in seen))
        return ",".join(names), [note for _, note in seen]

    def _forget_handled(self, ev: Change) -> None:
        """A follower sees the leader commit a plan: the changes before it are handled
        (kept only so that a new leader reports the right cause)."""
        k = ev.parsed
        if k is not None and k.kind is Kind.JOB_PLAN:
            self._operators.pop(k.name, None)  # the changes before it are in its decision
            d = self._queue.get(k.name)
            if d is not None and d.revision < ev.mod_revision:
                self._queue.forget(k.name)

    def _on_push(self, r: PushResult) -> None:
        if not r.ok:
            log.warning(
                "agent refused power plan node=%s generation=%d outcome=%s detail=%s",
                r.node, r.generation, r.outcome, r.detail,
            )
            return
        if r.outcome == "PARTIAL":
            log.warning("agent applied power plan partially node=%s generation=%d detail=%s", r.node, r.generation, r.detail)
        for rollout in self._rollouts.power_applied(r.node, r.generation, r.at):
            self._phase_reached(rollout, Phase.POWER_APPLIED)

    # ---- deciding ----

    def _process_queue(self) -> None:
        if self._repush_after_load:
            self._repush_after_load = False
            self._repush_all()
        for job, d in self._queue.due(self._clock.mono()):
            try:
                result = self._reconcile_job(job, d)
            except NotLeader:
                return
            except Conflict as exc:
                log.warning("plan commit conflict job=%s error=%s", job, exc)
                result = Result.CONFLICT
            except EtcdError as exc:
                log.warning("plan commit failed job=%s attempt=%d error=%s", job, d.attempts + 1, exc)
                result = Result.ETCD_ERROR
            except Exception:  # a bug must not stop the loop for every other job
                log.exception("reconcile failed job=%s attempt=%d", job, d.attempts + 1)
                result = Result.ERROR
            self.metrics.reconcile_total.labels(result=result.value).inc()
            if self._queue.settle(job, result, self._clock.mono()) is Action.REREAD:
                self._reread_job(job)

    def _reread_job(self, job: str) -> None:
        """After a lost compare-and-swap: read this job's keys (and the power keys the
        commit compared) again and fold them; the rest of the view stays."""
        nodes = self._conflict_nodes.pop(job, [])
        try:
            kvs, rev = self.etcd.get_prefix(keys.job_prefix(job))
            power = [(n, self.etcd.get(keys.power(n))) for n in nodes]
        except EtcdError as exc:
            log.warning("job re-read failed job=%s error=%s", job, exc)
            return  # the entry is due again after its backoff
        found = {kv.key for kv in kvs}
        folded = [("put", kv.key, kv.value, kv.mod_revision) for kv in kvs]
        for key in (keys.job_spec(job), keys.job_plan(job)):
            if key not in found:
                folded.append(("delete", key, b"", rev))
        for node, kv in power:
            if kv is not None:
                folded.append(("put", kv.key, kv.value, kv.mod_revision))
            elif node in self.view.power:
                folded.append(("delete", keys.power(node), b"", rev))
        at = self._clock.wall()
        for kind, key, value, mod_rev in folded:
            for j, cause in self.view.fold(kind, key, value, mod_rev):
                self._mark(j, cause, at, mod_rev)
        self._acks_due.add(job)
        log.info("job re-read after conflict job=%s revision=%d keys=%d", job, rev, len(folded))

    @gc_paused
    def _reconcile_job(self, job: str, d: DirtyJob) -> Result:
        """Re-plan ``job`` and commit a changed decision, with the cyclic collector paused
        from the re-plan to the commit's end: what they allocate survives (the plan, its
        parts, the nodes' power), and a young-generation collection between the re-plan's
        own pause and the commit's (triggered by the re-plan's allocations) scanned only
        those, on the failure's path (a p99 build of 1.5-1.6 ms against 0.74-0.78 at 1%
        of 262,144 GPUs failed, in-process harness). The collections run after it."""
        if job not in self.view.snap.jobs:
            self._job_plans.pop(job, None)
            self._rollouts.forget(job)
            self._retire(job)
            self._forget_job(job)
            return Result.OK
        now = self._clock.wall()
        try:
            spec = self.view.job_spec(job)
            overrides = convert.job_overrides(self.view.snap.job_overrides.get(job))
            changes = self.view.take_changes(job)
            jp = replan(self._job_plans.get(job), self.view.state, spec, changes, overrides=overrides)
        except (PlanningError, ValueError) as exc:
            self._job_plans.pop(job, None)
            self._record_unplannable(job, str(exc), d)
            self._operators.pop(job, None)
            return Result.UNPLANNABLE
        self._job_plans[job] = jp
        self._to_warm.add(job)
        result = jp.result
        if self._unplannable.pop(job, None) is not None:
            self.metrics.unplannable_jobs.set(len(self._unplannable))
        prev = self.view.plans.get(job)
        if prev is not None and result.same_decision(prev.decision()):
            self._operators.pop(job, None)
            return Result.OK
        by, notes = self._operator_fields(job)
        self._commit(Planned(job, result, prev, d.cause, d.detected_at, now, by, "; ".join(notes)))
        self._operators.pop(job, None)
        return Result.OK

    def _commit(self, p: Planned) -> None:
        session = self._session
        if session is None:
            raise NotLeader("not leading")
        commit, power, event, rev = self._build_and_commit(session, p)
        committed_at = self._clock.wall()
        self.view.record_commit(p, commit, power, rev)
        self._own_revs.add(rev)
        self._own_revs.update(commit.power_revs.values())  # power written ahead of the header
        self._power_seen.update(power)
        self.metrics.reconfigurations.labels(training_job=p.job, cause=p.cause).inc()
        degrees = changed_degrees(p)
        ratio = p.result.expected_throughput_ratio
        self.metrics.plan_observed(p.job, commit.generation, ratio, degrees, len(p.result.suspended_pins))
        self._acks_due.add(p.job)
        log.info(
            "plan committed job=%s generation=%d cause=%s ratio=%.4f nodes=%d",
            p.job, commit.generation, p.cause, p.result.expected_throughput_ratio, len(power),
        )
        ranks = self._rank_count(p.job, p.result)
        self._plan_ranks[p.job] = (commit.generation, ranks)
        rollout = Rollout(p.job, commit.generation, event, {n: np.generation for n, np in power.items()}, ranks)
        for phase in self._rollouts.start(rollout, p.detected_at, committed_at):
            if phase is not Phase.DETECTED:
                # the commit stored its event with "committed" (at the decision's time):
                # rewritten only when a later phase is reached, not once more per commit
                self._phase_reached(rollout, phase, store=phase is not Phase.COMMITTED)
        self._push(power)
        self._note_pins(p, commit.generation)

    def _build_and_commit(self, session: LeaderSession, p: Planned):
        """Build and commit the decision (the collector paused by ``_reconcile_job``: what
        this allocates survives, so the young-generation collections it would trigger
        between a failure and its commit, 0.5-0.9 ms each, 26 in 60 failures at 262,144
        GPUs, scan only live objects; they run after the commit)."""
        commit, power, event = build_commit(
            self.view, p, history_size=self._history_size, encoder=self._encoder
        )
        try:
            rev = commit_plan(session, commit)
        except Conflict:
            self._conflict_nodes[p.job] = sorted(commit.power)
            raise
        return commit, power, event, rev

    def _idle_work(self) -> None:
        """What a decision should not pay for, done while no message waits: free what
        the planner's memos let go of (``model.release_evicted``) and build the new
        plans' cap indexes."""
        release_evicted()
        if self._to_warm:
            self._warm_caps()

    def _warm_caps(self) -> None:
        """Build the GPU index of the new plans' cap maps (``MergedCaps.warm``) now, not
        in the next failure's decision. A plan made afresh (after a restart or a leader
        change, when the plan read from etcd tells no parts) is committed without a point
        look-up of its caps, so the first failure after it indexed every boosted GPU on
        its path: 20-odd ms with 1% of 262,144 GPUs failed."""
        jobs, self._to_warm = self._to_warm, set()
        for job in jobs:
            jp = self._job_plans.get(job)
            warm = getattr(jp.result.power_caps, "warm", None) if jp is not None else None
            if warm is not None:
                warm()

    def _rank_count(self, job: str, result: PlanResult) -> int:
        """The ranks of ``result``, counted from the job's last plan where it can."""
        prev = self._ranks.get(job)
        count = rank_count(result) if prev is None else rank_count_since(prev[0], prev[1], result)
        self._ranks[job] = (result, count)
        return count

    def _flush_rack_metrics(self) -> None:
        """The healthy-GPU and domain-size gauges of the racks whose GPUs or nodes changed
        (off the decision's path: a rack's count walks its GPUs, 72 in an NVL72)."""
        seen, self._racks_seen = self._racks_seen, set()
        for rack in seen:
            info = self.view.racks.get(rack)
            if info is not None:
                self.metrics.rack_observed(rack, self.view.healthy_gpus(rack), info.domain_size)
            else:  # a deleted rack's series goes with it
                self.metrics.rack_gone(rack)

    def _flush_ack_metrics(self) -> None:
        """``tpflex_plan_acked_generation`` of the jobs whose acks or plan changed (every
        replica folds both, so a standby exports the leader's value): the generation that
        as many ranks as the current plan runs have acked (ClusterView.acked_generation)."""
        due, self._acks_due = self._acks_due, set()
        for job in due:
            rec = self.view.plans.get(job)
            if rec is None or job not in self.view.snap.jobs:
                self._plan_ranks.pop(job, None)
                continue
            known = self._plan_ranks.get(job)
            if known is None or known[0] != rec.generation:
                known = self._plan_ranks[job] = (rec.generation, _plan_rank_count(rec))
            acked = self.view.acked_generation(job, known[1], rec.generation)
            self.metrics.plan_acked_generation.labels(training_job=job).set(acked)

    def _flush_power_metrics(self) -> None:
        """The cap gauges of the nodes whose power plans this process wrote (off the
        decision's path: a node's first gauges cost ~20 us per GPU to create)."""
        seen, self._power_seen = self._power_seen, {}
        for node, np in seen.items():
            self.metrics.power_observed(node, np.caps)

    def _note_pins(self, p: Planned, generation: int) -> None:
        """An event for every pin the new plan suspends or gives back; the plan itself
        lists the suspended ones."""
        for event in pin_events(p, generation, self._clock.wall()):
            log.warning("operator pins changed job=%s generation=%d kind=%s", p.job, generation, event.kind)
            try:
                append_event(self._session, self.view, event)
            except EtcdError as exc:  # the plan is committed; the event is informational
                log.warning("pin event not stored job=%s error=%s", p.job, exc)

    def _retire(self, job: str) -> None:
        """A deleted job: its plan and history leave etcd and the caps it set go back to
        TDP (planning.commit_retire)."""
        built = build_retire(self.view, job)
        if built is None:
            return
        retire, power = built
        session = self._session
        if session is None:
            raise NotLeader("not leading")
        replicas = len(self.view.plans[job].decision().replicas)
        try:
            rev = commit_retire(session, retire)
        except Conflict:
            self._conflict_nodes[job] = sorted(power)
            raise
        self.view.forget_plan(job, power, rev, retire.power_revs)
        self._own_revs.update(retire.power_revs.values())
        self._unplannable.pop(job, None)
        self.metrics.unplannable_jobs.set(len(self._unplannable))
        self.metrics.job_gone(job, replicas)
        for node, np in power.items():
            self.metrics.power_observed(node, np.caps)
        self._push(power)
        log.info("deleted job retired job=%s nodes_reset=%d", job, len(power))
        append_event(session, self.view, types_pb2.Event(
            at=self._clock.wall(), kind="job_deleted", job=job, cause="job_spec",
            reasons=[f"job {job} deleted: plan removed, {len(power)} node(s) back to TDP"]))

    def _forget_job(self, job: str) -> None:
        """A deleted job's per-job state leaves with its plan (a cluster that creates and
        deletes jobs must not keep each one's last plan alive)."""
        self._ranks.pop(job, None)
        self._operators.pop(job, None)
        self._plan_ranks.pop(job, None)
        self._conflict_nodes.pop(job, None)
        self._encoder.forget(job)

    def _push(self, power: dict[str, NodePower]) -> None:
        nodes = self.view.snap.nodes
        self.pusher.push_many(
            (node, reg.agent_address if (reg := nodes.get(node)) is not None else "", plan)
            for node, plan in power.items()
        )

    def _repush_all(self) -> None:
        self._push({node: power for node, (power, _) in self.view.power.items()})

    def _phase_reached(self, r: Rollout, phase: Phase, store: bool = True) -> None:
        self.metrics.phase(phase.value, r.reached[phase] - r.reached[Phase.DETECTED])
        log.info("reconfiguration phase reached job=%s generation=%d phase=%s", r.job, r.generation, phase.value)
        if store:
            self._unwritten[r.event.seq] = r  # stored when the loop is idle (off the hot path)

    def _flush_events(self) -> None:
        store_phases(self._session, self.view, self._unwritten)

    def _record_unplannable(self, job: str, reason: str, d: DirtyJob) -> None:
        if self._unplannable.get(job) == reason:
            return
        log.warning("job cannot be planned job=%s reason=%s", job, reason)
        session = self._session
        if session is None:
            raise NotLeader("not leading")
        by, notes = self._operator_fields(job)
        event = types_pb2.Event(
            at=self._clock.wall(), kind="plan_failed", job=job, cause=d.cause, reasons=[reason, *notes],
            by=by,
        )
        append_event(session, self.view, event)
        self._unplannable[job] = reason
        self.metrics.unplannable_jobs.set(len(self._unplannable))


def _plan_rank_count(rec) -> int:
    """The ranks a stored plan runs (its GPUs over every stage of every replica), from the
    decoded proto where the view has it, else from the decision (``PlanRecord``)."""
    if rec.result is None and rec.proto is not None:
        return sum(len(st.gpus) for rep in rec.proto.replicas for st in rep.stages)
    return rank_count(rec.decision())
