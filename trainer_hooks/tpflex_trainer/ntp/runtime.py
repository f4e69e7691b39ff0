"""``NtpRuntime``: one process's view of a nonuniform-TP job, the API the trainer hooks use.

Every live process of the job's default process group (active or idle) calls
``apply_plan`` with the same plan; it validates the plan (typed errors, before any
collective), agrees with the others on who still holds state, computes the new layout,
rebuilds the process groups, reshards weights + Adam state (peer recovery for units of
lost members, checkpoint fallback) and switches gradient sync. Active members then call
``train_step`` once per step.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tpflex_trainer.ntp import checkpoint as ckpt
from tpflex_trainer.ntp.config import GPTConfig, param_specs
from tpflex_trainer.ntp.errors import PlanError, UnitsUnavailableError
from tpflex_trainer.ntp.grad_sync import DEFAULT_BUCKET_BYTES, GradSync
from tpflex_trainer.ntp.groups import GroupCache, NtpGroups, check_world, device_for_backend
from tpflex_trainer.ntp.layout import (
    JobLayout,
    Member,
    MemberLayout,
    ReplicaLayout,
    ReplicaPlacement,
    plan_layout,
    validate_request,
)
from tpflex_trainer.ntp.model import ShardedGPT
from tpflex_trainer.ntp.optim import AdamSettings, adam_step
from tpflex_trainer.ntp.reshard import execute_plan
from tpflex_trainer.ntp.reshard_plan import lower_bound_units, plan_reshard
from tpflex_trainer.ntp.state import (
    LocalState,
    build_state,
    init_local_state,
    member_units,
    payload_numel,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReshardReport:
    source: str  # "live" (reshard/peer recovery), "checkpoint" or "init"
    step: int  # the step training resumes from
    units_moved: int
    peer_units: int  # units recovered from another replica
    bytes_moved: int  # whole job, all members
    lower_bound_bytes: int  # whole job: one copy of each unit a member needs and lacks
    bytes_sent: int  # by this member, measured on the wire buffers
    seconds: float  # the whole apply_plan
    phases: dict[str, float]  # agree_s, groups_s, transfer_s (P2P or checkpoint load), rebuild_s
    layout: JobLayout


@contextmanager
def _phase(phases: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = time.perf_counter() - t0


def _choose_source(plan, holders: list[Member], reader, allow_init: bool, cfg: GPTConfig) -> str:
    """live (reshard + peer recovery), checkpoint (nothing live, or units lost on every
    replica: the whole job rolls back) or init (a new job); else UnitsUnavailableError."""
    if not holders:
        if reader is not None:
            return "checkpoint"
        if allow_init:
            return "init"
        raise UnitsUnavailableError({f: list(range(n)) for f, n in cfg.unit_counts().items()})
    if plan.missing:
        if reader is None:
            raise UnitsUnavailableError({f: list(u) for f, u in plan.missing.items()})
        return "checkpoint"
    return "live"


class NtpRuntime:
    def __init__(
        self,
        cfg: GPTConfig,
        base_tp: int,
        me: Member | tuple[int, int],
        *,
        adam: AdamSettings = AdamSettings(),
        seed: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: timedelta = timedelta(seconds=60),
    ) -> None:
        self.cfg, self.base_tp, self.me = cfg, base_tp, Member(*me)
        self.adam, self.seed, self.bucket_bytes, self.timeout = adam, seed, bucket_bytes, timeout
        self.specs = param_specs(cfg)
        self.unit_bytes = {f: 4 * payload_numel(self.specs, f) for f in [*cfg.unit_counts(), "_replicated"]}
        self.layout: JobLayout | None = None
        self.world: dict[Member, int] = {}
        self.state: LocalState | None = None
        self.groups = NtpGroups()
        self.group_cache = GroupCache(timeout)
        self.model: ShardedGPT | None = None
        self.sync: GradSync | None = None

    # ------------------------------------------------------------------ queries
    @property
    def active(self) -> bool:
        return self.model is not None

    @property
    def step(self) -> int:
        return self.state.step if self.state is not None else 0

    # ------------------------------------------------------------------ plans
    def start(self, placements: Sequence[ReplicaPlacement], world: Mapping[Member, int], checkpoint: str | os.PathLike | None = None) -> ReshardReport:
        """First layout of a job: from ``checkpoint`` when given, else from the seed."""
        return self.apply_plan(placements, world, checkpoint=checkpoint, allow_init=True)

    def apply_plan(
        self,
        placements: Sequence[ReplicaPlacement],
        world: Mapping[Member, int],
        checkpoint: str | os.PathLike | None = None,
        allow_init: bool = False,
    ) -> ReshardReport:
        """Collective over the default group: every live process calls it with the same
        ``placements`` and ``world`` (member -> rank in the current default group)."""
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        placements = tuple(placements)
        world = {Member(*m): r for m, r in world.items()}
        validate_request(self.cfg.unit_counts(), placements, self.base_tp)
        check_world(placements, world, self.me, dist.get_world_size(), dist.get_rank())
        reader = ckpt.CheckpointReader(checkpoint, self.cfg) if checkpoint is not None else None
        with _phase(phases, "agree_s"):
            previous, holders, step = self._agree()
        new = plan_layout(self.cfg.unit_counts(), placements, self.base_tp, previous, holders)
        plan = plan_reshard(previous, new, holders)
        source = _choose_source(plan, holders, reader, allow_init, self.cfg)
        with _phase(phases, "groups_s"):
            self._teardown()
            self.groups = self.group_cache.build(new, world, self.me)
        with _phase(phases, "transfer_s"):
            step, sent = self._load_state(source, plan, new, world, step, reader)
        with _phase(phases, "rebuild_s"):
            self.layout, self.world = new, world
            if self.state is not None:
                self._build_training()
        live = source == "live"
        lower = lower_bound_units(previous, new, holders) if live else lower_bound_units(None, new, [])
        report = ReshardReport(
            source=source,
            step=step,
            units_moved=len(plan.transfers) if live else 0,
            peer_units=plan.peer_units() if live else 0,
            bytes_moved=plan.bytes_moved(self.unit_bytes) if live else 0,
            lower_bound_bytes=sum(self.unit_bytes[f] * n for f, n in lower.items()),
            bytes_sent=sent,
            seconds=time.perf_counter() - t0,
            phases=phases,
            layout=new,
        )
        log.info(
            "ntp plan applied member=%s source=%s step=%d units_moved=%d peer_units=%d bytes_moved=%d seconds=%.3f",
            tuple(self.me), source, step, report.units_moved, report.peer_units, report.bytes_moved, report.seconds,
        )
        return report

    def _load_state(self, source, plan, new: JobLayout, world, step: int, reader) -> tuple[int, int]:
        """This member's state in the new layout; returns (step, bytes sent)."""
        mine = new.member(self.me)
        units = member_units(mine.units) if mine is not None else None
        device = device_for_backend()
        if source == "live":
            self.state, sent = execute_plan(plan, self.me, world, self.state, units, self.specs, step, device)
            return step, sent
        if source == "checkpoint":
            self.state = build_state(self.specs, units, reader.step, device, reader.payload) if units else None
            return reader.step, 0
        self.state = init_local_state(self.specs, units, self.seed, device) if units else None
        return 0, 0

    def _agree(self) -> tuple[JobLayout | None, list[Member], int]:
        """Who holds state at the newest step, which step, and what each holds. Every
        member reports its own units, so an interrupted reshard (some members already in
        the new layout, others still in the old one) is resolved like any other start
        layout. Members left behind by a torn step (the failure hit between members'
        optimizer updates) count as holding nothing: their units are re-sent from
        up-to-date holders, or the job rolls back to a checkpoint."""
        gathered: list = [None] * dist.get_world_size()
        settings = (self.cfg, self.base_tp, self.bucket_bytes)
        mine = self.layout.member(self.me) if self.layout is not None and self.state is not None else None
        held = (mine.tp_rank, dict(mine.units)) if mine is not None else None
        dist.all_gather_object(gathered, (tuple(self.me), held, self.step, self.group_cache.intact(), settings))
        differing = sorted({tuple(m) for m, *_, other in gathered if other != settings})
        if differing:
            raise PlanError(
                f"members {differing} run another model config, base_tp or bucket size than "
                f"member {tuple(self.me)}: {[g[-1] for g in gathered]}"
            )
        if not all(g[3] for g in gathered):
            self.group_cache.abandon()  # someone lost its groups: everyone builds anew
        steps = {step for _, held, step, *_ in gathered if held is not None}
        if not steps:
            return None, [], 0
        newest = max(steps)
        if len(steps) > 1:
            log.warning("ntp torn step member=%s steps=%s resume_step=%d", tuple(self.me), sorted(steps), newest)
        reports = {Member(*m): held for m, held, step, *_ in gathered if held is not None and step == newest}
        return self._held_layout(reports), list(reports), newest

    def _held_layout(self, reports: Mapping[Member, tuple[int, dict]]) -> JobLayout:
        """A layout describing what the holders hold (only members and units are used)."""
        replicas = []
        for replica in sorted({m.replica for m in reports}):
            members = sorted((m for m in reports if m.replica == replica), key=lambda m: reports[m][0])
            layouts = tuple(MemberLayout(m, reports[m][0], False, reports[m][1]) for m in members)
            replicas.append(ReplicaLayout(replica, 1, layouts))
        families = tuple(self.cfg.unit_counts().items())
        return JobLayout(self.base_tp, families, 0, {}, tuple(replicas))

    def _teardown(self) -> None:
        if self.sync is not None:
            self.sync.close()
        self.model = self.sync = None
        self.groups = NtpGroups()

    def _build_training(self) -> None:
        assert self.state is not None and self.layout is not None
        self.model = ShardedGPT(self.cfg, self.state.units, self.state.tensors["param"], self.groups.tp)
        params = self.model.params_in_spec_order()
        self.sync = GradSync(params, self.layout, self.me, self.world, self.groups, self.bucket_bytes)

    # ------------------------------------------------------------------ training
    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimizer step on this replica's local batch; returns the global mean loss
        (the same on every active member)."""
        if self.model is None or self.layout is None or self.state is None:
            raise PlanError(f"member {tuple(self.me)} is not active in the current plan")
        if not self.group_cache.intact():
            self._rebind_for_step()
        rep = self.layout.replica(self.me.replica)
        if tokens.shape[0] != rep.local_batch or tokens.shape != targets.shape:
            raise PlanError(f"local batch must be {rep.local_batch} samples, got tokens {tuple(tokens.shape)}")
        device = self.state.tensors["param"]["pos.weight"].device
        self.sync.begin(rep.local_batch / self.layout.global_batch)
        loss = self.model.loss(tokens.to(device), targets.to(device))
        loss.backward()
        global_loss = self.sync.finish(loss.detach())
        adam_step(self.state, {s.name: p.grad for s, p in self.model.params_in_spec_order()}, self.adam)
        return global_loss

    def rebind(self) -> ReshardReport:
        """Collective over a re-initialised default group whose processes all hold state in
        the current layout: rebuild the process groups for it (moves nothing). The world
        map is learned from the processes themselves."""
        if self.layout is None:
            raise PlanError("no layout yet: call start() first")
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, tuple(self.me))
        return self.apply_plan(self.layout.placements(), {Member(*m): r for r, m in enumerate(gathered)})

    def _rebind_for_step(self) -> None:
        """``train_step`` found groups of a destroyed default group. When the new default
        group is exactly the active members (all of them are in ``train_step`` now), they
        rebind together; otherwise the caller must call ``apply_plan``."""
        assert self.layout is not None
        if dist.get_world_size() != len(self.layout.members()):
            raise PlanError(
                "the default process group was re-initialised since the last plan and is not "
                "the plan's members: call apply_plan(placements, new_world) on every process"
            )
        log.info("ntp rebinding groups to a re-initialised default group member=%s", tuple(self.me))
        self.rebind()

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Collective over the active members: replica ``layout.replicas[0]`` writes its
        units, then the meta file marking the checkpoint complete."""
        if self.layout is None:
            raise PlanError("no layout yet: call start() first")
        path = Path(path)
        writers = self.layout.replicas[0]
        mine = self.layout.member(self.me)
        if mine is not None and self.me.replica == writers.replica and self.state is not None:
            ckpt.write_member_units(path, mine, self.state, self.specs)
        sync_group = self.groups.active or self.groups.tp
        if sync_group is not None:
            dist.barrier(group=sync_group)
        if mine is not None and self.me.replica == writers.replica and mine.tp_rank == 0:
            ckpt.write_meta(path, self.cfg, self.step, [ckpt.member_file(m) for m in writers.members])
        if sync_group is not None:
            dist.barrier(group=sync_group)

    def abort(self) -> None:
        """Call when a collective failed or a member is known to be gone, before the default
        group is re-initialised: destroys this process's NTP groups and drops every
        reference to them (model, gradient sync), so that peers still blocked in those
        groups fail at once instead of waiting for the collective timeout. Weights and
        Adam state are kept (an optimizer update is local and all-or-nothing), so the next
        ``apply_plan`` can recover from them."""
        self._teardown()
        self.group_cache.abandon()
        gc.collect()  # autograd graphs of the failed step may still reference the groups

    def close(self) -> None:
        self._teardown()
        self.group_cache.close()
        self.state = None
