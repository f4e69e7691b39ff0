"""``TpflexHooks``: what a training script adopts to follow the controller's plans.

    hooks = TpflexHooks.from_env(GPTConfig(...))   # or a Hugging Face model directory
    hooks.start()                                  # register, fetch the plan, build the layout
    while hooks.step < steps:
        loss = hooks.train_step(global_batch)      # global_batch(step, samples) -> (tokens, targets)
    hooks.close()

At each step boundary the active ranks agree (one tiny all-reduce) on the newest plan
generation any of them has received and apply it together: re-rendezvous, reshard through
the NTP runtime, ack. When a collective fails because a peer died, the survivors abort
their process groups at once (so nobody waits for a collective timeout), wait for the
controller's next plan, re-initialise in-process with the ranks that plan uses, recover
the lost units from a peer replica (or the checkpoint) and resume from the last step that
every survivor completed. A process started fresh by a launcher joins the same way: it
gets the current plan at start-up and receives its units from live peers, or loads the
latest checkpoint when nobody holds state.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from tpflex_proto import controller_pb2, types_pb2

from tpflex_trainer.hooks.abort import GroupSockets, RoundAborts, abort_reason
from tpflex_trainer.hooks.checkpoints import CheckpointDir
from tpflex_trainer.hooks.config import HooksConfig, load_spec
from tpflex_trainer.hooks.control import (
    ControlClient,
    ControlConfig,
    PlanRejected,
    RegistrationRefused,
    plan_round,
)
from tpflex_trainer.hooks.plans import (  # noqa: F401  (HooksError, plan_placements: public here too)
    AppliedPlan,
    HooksError,
    endpoint_ports,
    plan_placements,
    round_name,
    spec_ranks,
    spec_stages,
)
from tpflex_trainer.hooks.rendezvous import (
    RendezvousAbandoned,
    connect_store,
    forget_generation,
    join_generation,
    store_gives_up,
)
from tpflex_trainer.hooks.watchdog import Watchdog, dump_stacks
from tpflex_trainer.ntp.config import GPTConfig
from tpflex_trainer.ntp.errors import NtpError
from tpflex_trainer.ntp.layout import Member, ReplicaPlacement
from tpflex_trainer.ntp.model_units import of_runtime_model
from tpflex_trainer.ntp.optim import AdamSettings, TrainSettings
from tpflex_trainer.ntp.runtime import NtpRuntime, ReshardReport

log = logging.getLogger(__name__)

BatchFn = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


class RefusedByController(HooksError):
    """RegisterJob refused this trainer for good: the units its model adapter derived
    contradict the job spec (the message names the family). Not worth a retry: exit 2."""


class TpflexHooks:
    def __init__(
        self,
        config: HooksConfig,
        model: GPTConfig | str | os.PathLike,
        *,
        spec: types_pb2.JobSpec | None = None,
        adam: AdamSettings = AdamSettings(),
        seed: int = 0,
        train: TrainSettings = TrainSettings(),
    ) -> None:
        self.config = config
        self.spec = spec if spec is not None else load_spec(config.spec_file)
        if self.spec.name != config.job:
            raise HooksError(f"job spec is for {self.spec.name!r}, TPFLEX_JOB is {config.job!r}")
        ranks = spec_ranks(self.spec)
        mine = [(i, m) for i, (m, gpu) in enumerate(ranks) if gpu == (config.node, config.gpu)]
        if not mine:
            raise HooksError(f"GPU {config.node}:{config.gpu} is not a rank of job {config.job}")
        self.rank, self.me = mine[0]
        self.model_config = model
        self.backend = config.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        sockets = GroupSockets(endpoint_ports(
            [*config.controller, *config.store.removeprefix("tpflex://").split(",")]))
        self.aborts = RoundAborts(
            groups=lambda: self.runtime.group_cache.groups.values(), applied=lambda: (self.plan, self.epoch),
            active=lambda: self.active, sockets=sockets if self.backend == "gloo" else None,
            label=f"job={config.job} rank={self.rank}", guarded_since=lambda: self.watchdog.since())
        self.runtime = NtpRuntime(
            model, self.spec.base_tp, self.me, adam=adam, seed=seed, train=train,
            timeout=timedelta(seconds=config.collective_timeout_s), stages=spec_stages(self.spec),
        )
        self.client = ControlClient(ControlConfig(
            endpoints=config.controller, job=config.job, rank=self.rank,
            tls_ca_file=config.tls_ca_file or None,
            tls_cert_file=config.tls_cert_file or None,
            tls_key_file=config.tls_key_file or None,
            tls_server_name=config.tls_server_name or None,
            credential=config.job_credential or None,
            beat_interval_s=config.beat_interval_s, incarnation=config.incarnation,
            beat_file=config.beat_file,
        ), on_round=self.aborts.on_round, beat_state=self._beat_state)
        self.watchdog = Watchdog(config.watchdog_after_s, self._on_hang)
        self.store: dist.Store | None = None
        self.generation = 0
        self.epoch = 0  # the restart epoch applied (Plan.restart.epoch)
        self.plan: types_pb2.Plan | None = None
        self.world: dict[Member, int] = {}
        self.history: list[AppliedPlan] = []
        self.failures = 0
        self.checkpoints = CheckpointDir(config.checkpoint_dir, config.checkpoint_every)
        self._refused_generation = 0  # newest plan refused at a step boundary

    @classmethod
    def from_env(cls, model: GPTConfig | str | os.PathLike, **kwargs) -> TpflexHooks:
        return cls(HooksConfig.from_env(), model, **kwargs)

    # ------------------------------------------------------------------ queries
    @property
    def step(self) -> int:
        return self.runtime.step

    @property
    def active(self) -> bool:
        return self.runtime.active

    @property
    def tp_degree(self) -> int:
        if not self.active or self.runtime.layout is None:
            return 0
        return self.runtime.layout.replica(self.me.replica).degree

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> AppliedPlan:
        """Register the job, wait for its plan, join the job's current layout."""
        if self.config.cuda_device >= 0 and torch.cuda.is_available():
            torch.cuda.set_device(self.config.cuda_device)  # TPFLEX_CUDA_DEVICE from tpflex-run
        # an NCCL error (or an abort) cleans the communicator up without ending the process
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        self.client.start()
        self.watchdog.start()
        self.store = connect_store(self.config.store, self.config.plan_wait_s, control=self.client.config)
        model = of_runtime_model(self.model_config, self.runtime.model_adapter, self.spec.base_tp)
        try:
            self.client.register_job(self.spec, model)
        except RegistrationRefused as exc:  # this model cannot train this spec: no use waiting
            raise RefusedByController(f"the controller refused job {self.config.job}: {exc}") from None
        except Exception as exc:  # the plan stream retries on its own; registration is idempotent
            log.warning("job registration failed job=%s rank=%d error=%s", self.config.job, self.rank, exc)
        plan = self.client.wait_for_generation(1, self.config.plan_wait_s)
        if plan is None:
            raise HooksError(f"no plan for job {self.config.job} from {self.config.controller} "
                             f"within {self.config.plan_wait_s:.0f}s")
        return self._enter(plan, mode="join")

    def close(self) -> None:
        self.client.end_beats()  # first: flushing may take seconds, which is no hang
        self.watchdog.stop()
        self.client.flush(2.0)
        self.client.close()
        self.runtime.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ training
    def train_step(self, batch: BatchFn) -> float | None:
        """Apply any newer plan, then run one step on this replica's share of
        ``batch(step, samples)``; returns the global loss, or None while this rank is idle
        (not in the current plan: it waits for a plan that uses it)."""
        while True:
            if not self.active:
                if not self._wait_until_used():
                    return None
                continue
            failure = ""
            try:
                if self.checkpoints.due(self.step):  # at the step boundary: a failure here loses no step
                    self.checkpoints.save(self.runtime, self.step, writer=self.world.get(self.me) == 0)
                if self._follow_newer_plan():
                    continue  # a new layout: agree again (newcomers start with the agreement)
                with self.watchdog.guard():  # the step's collectives (a re-plan has its own deadline)
                    return self._run_step(batch)
            except (RuntimeError, dist.DistError) as exc:
                if isinstance(exc, NtpError | HooksError):
                    raise
                failure = f"{type(exc).__name__}: {str(exc)[:300]}"
            # Outside the except block: the traceback (and the process groups its frames
            # reference) is gone, so aborting really closes our connections and peers
            # still blocked on us fail at once instead of at the collective timeout.
            self._recover(failure)

    def _run_step(self, batch: BatchFn) -> float:
        layout = self.runtime.layout
        step = self.step
        tokens, targets = batch(step, layout.global_batch)
        offset = 0
        for rep in layout.replicas:
            if rep.replica == self.me.replica:
                break
            offset += rep.local_batch
        local = layout.replica(self.me.replica).local_batch
        t0 = time.perf_counter()
        loss = self.runtime.train_step(tokens[offset:offset + local], targets[offset:offset + local])
        seconds = time.perf_counter() - t0
        self.client.report_step(controller_pb2.StepReport(
            job=self.config.job, rank=self.rank, replica=self.me.replica, step=step,
            generation=self.generation, step_seconds=seconds, samples=local,
            tokens=local * tokens.shape[1], loss=loss, at=time.time(),
            tp_degree=self.tp_degree, base_tp=self.spec.base_tp,
        ))
        return loss

    # ------------------------------------------------------------------ plans
    def _follow_newer_plan(self) -> bool:
        """Step boundary: the active ranks agree on the newest generation any has seen and
        apply it together; returns whether a plan was applied."""
        seen = max(plan_round(self.client.latest_plan()), (self.generation, self.epoch))
        from tpflex_trainer.ntp.groups import device_for_backend

        t = torch.tensor(list(seen), dtype=torch.int64, device=device_for_backend())
        with self.watchdog.guard():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        self.runtime.confirm_step()  # every rank is past the last update: a torn step is behind us
        newest = (int(t[0].item()), int(t[1].item()))
        if newest[0] <= max(self.generation, self._refused_generation) and newest[1] <= self.epoch:
            return False
        plan = self.client.wait_for_round((newest[0] - 1, 1 << 62) if newest[0] > self.generation
                                          else (self.generation, newest[1] - 1), self.config.plan_wait_s)
        if plan is None:
            raise HooksError(f"peers have plan generation {newest[0]} epoch {newest[1]}, this rank did "
                             "not receive it")
        try:  # every rank decides alike: same plan, same spec
            self._placements(plan)
        except (PlanRejected, NtpError) as exc:
            self._refused_generation = plan.generation
            log.warning("plan refused job=%s rank=%d generation=%d reason=%s keeping_generation=%d",
                        self.config.job, self.rank, plan.generation, exc, self.generation)
            return False
        self._enter(plan, mode="transition")
        return True

    def _placements(self, plan: types_pb2.Plan) -> tuple[ReplicaPlacement, ...]:
        applied = self.generation
        if plan.generation == applied and plan.restart.epoch > self.epoch:
            applied -= 1  # the same plan again, in a newer restart epoch: re-form the groups
        return plan_placements(plan, self.spec, self.config.job, applied,
                               [a.unit_counts for a in self.runtime.stage_adapters])

    def _wait_until_used(self) -> bool:
        plan = self.client.wait_for_round((self.generation, self.epoch), self.config.plan_wait_s)
        if plan is None:
            return False
        self._enter(plan, mode="join")
        return True

    def _recover(self, failure: str) -> None:
        """A collective failed: a peer is gone. Abort, wait for the re-plan, rejoin."""
        self.failures += 1
        log.warning("collective failed job=%s rank=%d generation=%d step=%d error=%s",
                    self.config.job, self.rank, self.generation, self.step, failure)
        t0 = time.monotonic()
        self.runtime.abort()
        if dist.is_initialized():
            dist.destroy_process_group()
        log.info("process groups dropped job=%s rank=%d generation=%d seconds=%.3f",
                 self.config.job, self.rank, self.generation, time.monotonic() - t0)
        plan = self.client.wait_for_round((self.generation, self.epoch), self.config.plan_wait_s)
        if plan is None:
            raise HooksError(
                f"a peer failed at generation {self.generation} and no new plan arrived within "
                f"{self.config.plan_wait_s:.0f}s: {failure}"
            )
        self._enter(plan, mode="failure")

    def _enter(self, plan: types_pb2.Plan, mode: str) -> AppliedPlan:
        """Join ``plan`` (or a newer one that arrives while waiting for the others)."""
        while True:
            try:
                placements = self._placements(plan)
            except (PlanRejected, NtpError) as exc:
                log.warning("plan refused job=%s rank=%d generation=%d reason=%s",
                            self.config.job, self.rank, plan.generation, exc)
                newer = self.client.wait_for_round(plan_round(plan), self.config.plan_wait_s)
                if newer is None:
                    raise HooksError(f"plan generation {plan.generation} refused: {exc}") from exc
                plan = newer
                continue
            members = sorted(Member(p.replica, s, p.stage) for p in placements for s in p.slots)
            if self.me not in members and mode != "transition":
                return self._go_idle(plan, mode)
            world = self._world_for(members, mode)
            failed, broken = "", False
            try:
                return self._apply(plan, placements, members, world, mode)
            except RendezvousAbandoned as exc:
                log.info("rendezvous abandoned job=%s rank=%d reason=%s", self.config.job, self.rank, exc)
                failed = str(exc)
            except (RuntimeError, dist.DistError) as exc:
                if isinstance(exc, NtpError | HooksError):
                    raise
                # a member died while the plan was being applied (its reshard's collectives
                # failed): this process keeps its state (nothing is replaced before a
                # transfer completes) and joins the round its death brings
                failed = f"{type(exc).__name__}: {str(exc)[:300]}"
                log.warning("plan apply failed job=%s rank=%d generation=%d epoch=%d error=%s",
                            self.config.job, self.rank, plan.generation, plan.restart.epoch, failed)
                mode, broken = ("failure" if mode == "transition" else mode), True
            plan = self._after_failed_round(plan, failed, broken)

    def _after_failed_round(self, plan: types_pb2.Plan, failed: str, broken: bool) -> types_pb2.Plan:
        """Outside the except block (its frames hold the groups): drop a broken round's
        groups, wait for the controller's next round."""
        if broken:
            self.runtime.abort()
            if dist.is_initialized():
                dist.destroy_process_group()
        newer = self.client.wait_for_round(plan_round(plan), self.config.plan_wait_s)
        if newer is None:
            raise HooksError(f"generation {plan.generation} epoch {plan.restart.epoch}: {failed}; no newer "
                             f"plan within {self.config.plan_wait_s:.0f}s")
        return newer

    def _world_for(self, members: list[Member], mode: str) -> dict[Member, int]:
        """Who takes part in the reshard: the plan's members, plus (on a planned transition)
        the current members, so that leaving ranks can hand over their units."""
        everyone = set(members)
        if mode == "transition":
            everyone |= set(self.world)
        elif mode == "join":
            everyone |= set(self._published_world())
        return {m: i for i, m in enumerate(sorted(everyone))}

    def _apply(self, plan, placements, members, world, mode) -> AppliedPlan:
        newer = lambda: plan_round(self.client.latest_plan()) > plan_round(plan)  # noqa: E731
        self.aborts.entering(plan_round(plan))
        # groups formed while applying wait for their members' addresses in the store; a
        # member gone since (a newer round that aborts this one) will never publish its own
        with self._tracked(), store_gives_up(self.store, lambda: self._member_gone(plan)):
            self._rendezvous(plan, "", world, newer)
            t0 = time.perf_counter()
            if self.runtime.layout is None:
                report = self.runtime.start(placements, world, self.checkpoints.latest())
            else:
                report = self.runtime.apply_plan(placements, world, self.checkpoints.latest())
        if set(world) != set(members):  # leaving ranks are done: shrink to the plan's members
            if self.me not in members:
                return self._go_idle(plan, mode, report)
            with self._tracked():
                self._rendezvous(plan, "a", {m: i for i, m in enumerate(members)}, newer)
            self.world = {m: i for i, m in enumerate(members)}
        else:
            self.world = world
        return self._applied(plan, report, mode, time.perf_counter() - t0)

    def _member_gone(self, plan: types_pb2.Plan) -> bool:
        """Whether the controller announced a newer round because a member of ``plan``'s
        round is gone (the plan-stream abort's condition): a newer restart epoch, or a
        failure generation dropping one of its GPUs."""
        latest = self.client.latest_plan()
        return latest is not None and bool(abort_reason(latest, plan, plan.restart.epoch))

    def _tracked(self):
        """Around building groups: gloo's new connections are the ones an abort shuts."""
        return self.aborts.sockets.track() if self.aborts.sockets is not None else contextlib.nullcontext()

    def _rendezvous(self, plan: types_pb2.Plan, suffix: str, world, give_up) -> None:
        join_generation(
            self.store, self.config.job, f"{round_name(plan)}{suffix}",
            world, self.me, backend=self.backend,
            collective_timeout=timedelta(seconds=self.config.collective_timeout_s),
            give_up=give_up, deadline_s=self.config.plan_wait_s,
        )

    def _applied(self, plan, report: ReshardReport, mode: str, seconds: float) -> AppliedPlan:
        previous = round_name(self.plan) if self.plan is not None else ""
        self.generation, self.epoch, self.plan = plan.generation, plan.restart.epoch, plan
        self.checkpoints.skip(report.step)  # every member resumes at report.step
        if self.world and self.world.get(self.me) == 0:
            self.store.set(f"tpflex/{self.config.job}/world",
                           json.dumps({"generation": plan.generation, "members": [list(m) for m in self.world]}))
            if previous and previous != round_name(plan):  # every member has left it
                forget_generation(self.store, self.config.job, previous)
        applied = AppliedPlan(
            generation=plan.generation, tp_degree=self.tp_degree, world_size=len(self.world),
            source=report.source, step=report.step, reshard_s=seconds, bytes_moved=report.bytes_moved,
            peer_units=report.peer_units, after_failure=mode == "failure", applied_at=time.time(),
            bytes_sent=report.bytes_sent, epoch=plan.restart.epoch, behind=tuple(map(tuple, report.behind)),
        )
        self.history.append(applied)
        self.client.ack(plan.generation, seconds)
        log.info("plan applied job=%s rank=%d generation=%d tp=%d source=%s step=%d reshard_s=%.3f",
                 self.config.job, self.rank, plan.generation, applied.tp_degree, report.source,
                 report.step, seconds)
        return applied

    def _go_idle(self, plan, mode: str, report: ReshardReport | None = None) -> AppliedPlan:
        """This rank's GPU is not in the plan: leave the groups and wait to be used again."""
        self.runtime.abort()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.generation, self.epoch, self.plan, self.world = plan.generation, plan.restart.epoch, plan, {}
        applied = AppliedPlan(plan.generation, 0, 0, "idle", report.step if report else self.step,
                              0.0, 0, 0, mode == "failure", time.time(), epoch=plan.restart.epoch)
        self.history.append(applied)
        self.client.ack(plan.generation, 0.0)
        log.info("rank idle job=%s rank=%d generation=%d", self.config.job, self.rank, plan.generation)
        return applied

    def _published_world(self) -> list[Member]:
        key = f"tpflex/{self.config.job}/world"
        if self.store is None or not self.store.check([key]):
            return []
        data = json.loads(self.store.get(key))
        return [Member(*m) for m in data["members"]]

    # ------------------------------------------------------------------ liveness
    def _beat_state(self) -> tuple[int, int, int, float]:
        return self.generation, self.epoch, self.step, self.watchdog.hung_s()

    def _on_hang(self, stuck_s: float) -> None:
        """Watchdog thread: this rank's step has been stuck in collectives too long."""
        log.error("collective hang job=%s rank=%d generation=%d epoch=%d step=%d stuck_s=%.1f",
                  self.config.job, self.rank, self.generation, self.epoch, self.step, stuck_s)
        dump_stacks(f"collective hang {stuck_s:.1f}s")
        self.aborts.abort(f"watchdog: stuck {stuck_s:.1f}s")
