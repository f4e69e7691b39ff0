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
from tpflex_trainer.ntp import collectives, persist, torn
from tpflex_trainer.ntp.adapter import as_adapter
from tpflex_trainer.ntp.config import REPLICATED
from tpflex_trainer.ntp.errors import PlanError, UnitsUnavailableError
from tpflex_trainer.ntp.grad_sync import DEFAULT_BUCKET_BYTES, GradSync
from tpflex_trainer.ntp.groups import GroupCache, NtpGroups, check_world, device_for_backend
from tpflex_trainer.ntp.layout import (
    JobLayout,
    Member,
    MemberLayout,
    ReplicaLayout,
    ReplicaPlacement,
    validate_request,
)
from tpflex_trainer.ntp.optim import AdamSettings, TrainSettings, adam_step
from tpflex_trainer.ntp.persist import stage_key as _stage_key
from tpflex_trainer.ntp.pipeline import PipelineStep, stage_links
from tpflex_trainer.ntp.reshard import execute_plan
from tpflex_trainer.ntp.reshard_plan import lower_bound_units, plan_reshard
from tpflex_trainer.ntp.stage_adapter import stage_view
from tpflex_trainer.ntp.stages import plan_stages, split_stages
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
    # members a torn step left a step behind: they counted as holding nothing and were sent
    # their units at ``step`` (empty when every member was at the same step, or when the
    # members ahead undid their update instead)
    behind: tuple[Member, ...] = ()


@contextmanager
def _phase(phases: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = time.perf_counter() - t0


def _choose_source(missing: Mapping[str, Sequence[int]], holders: list[Member], reader, allow_init: bool,
                   all_units: Mapping[str, int]) -> str:
    """live (reshard + peer recovery), checkpoint (nothing live, or units lost on every
    replica, in any stage: the whole job rolls back) or init (a new job); else
    UnitsUnavailableError."""
    if not holders:
        if reader is not None:
            return "checkpoint"
        if allow_init:
            return "init"
        raise UnitsUnavailableError({f: list(range(n)) for f, n in all_units.items()})
    if missing:
        if reader is None:
            raise UnitsUnavailableError({f: list(u) for f, u in missing.items()})
        return "checkpoint"
    return "live"





# Test hook: every sharded gradient is multiplied by this after the sync (a deliberately
# broken run, which the parity checks must catch). Unset in real runs.
GRAD_SCALE_ENV = "TPFLEX_TEST_SHARDED_GRAD_SCALE"


def _stage(layouts: tuple[JobLayout, ...] | None, stage: int) -> JobLayout | None:
    if layouts is None:
        return None
    return next((lay for lay in layouts if lay.stage == stage), None)


class NtpRuntime:
    """``model``: a ``GPTConfig``, a ``ModelAdapter`` or a Hugging Face model directory."""

    def __init__(
        self,
        model,
        base_tp: int,
        me: Member | tuple[int, ...],
        *,
        adam: AdamSettings = AdamSettings(),
        seed: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: timedelta = timedelta(seconds=60),
        train: TrainSettings = TrainSettings(),
        stages: int = 1,
    ) -> None:
        self.cfg, self.base_tp, self.me = model, base_tp, Member(*me)
        if stages < 1 or not 0 <= self.me.stage < stages:
            raise PlanError(f"member {tuple(self.me)} is not in a stage of a {stages}-stage pipeline")
        self.model_adapter = as_adapter(model, base_tp)
        self.n_stages = stages
        # one adapter per stage (the model itself with one stage); this member's is its stage's
        self.stage_adapters = [stage_view(self.model_adapter, k, stages) for k in range(stages)]
        self.adapter = self.stage_adapters[self.me.stage]
        self.adam, self.seed, self.bucket_bytes, self.timeout = adam, seed, bucket_bytes, timeout
        self.train = train
        self.specs = self.adapter.specs
        self.decay = {s.name: s.decay for s in self.specs}
        self.stage_unit_bytes = [
            {f: 4 * payload_numel(a.specs, f) for f in [*a.all_unit_counts(), REPLICATED]}
            for a in self.stage_adapters
        ]
        self.unit_bytes = self.stage_unit_bytes[self.me.stage]
        self.grad_scale = float(os.environ.get(GRAD_SCALE_ENV, "1") or 1)
        self.fault = torn.FaultHook(os.environ.get(torn.FAULT_ENV))
        self.undo: LocalState | None = None  # this member's state before its last update (torn)
        self.last_grad_norm = 0.0
        self.layout: JobLayout | None = None  # this member's stage
        self.stage_layouts: tuple[JobLayout, ...] = ()  # every stage, in stage order
        self.pipe: PipelineStep | None = None
        self.world: dict[Member, int] = {}
        self.state: LocalState | None = None
        self.groups = NtpGroups()
        self.group_cache = GroupCache(timeout)
        self.model = None
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
        self._validate(placements)
        check_world(placements, world, self.me, dist.get_world_size(), dist.get_rank())
        reader = ckpt.CheckpointReader(checkpoint, self.adapter.fingerprint()) if checkpoint is not None else None
        with _phase(phases, "agree_s"):
            (previous, holders, step), rollback, behind = self._agree()
        new, plans, missing = self._plan_layouts(placements, previous, holders)
        if missing and rollback is not None:  # a torn step whose newest copy of some unit is gone
            older = self._plan_layouts(placements, *rollback[:2])
            if not older[2]:  # every unit at the older step: the members ahead undo their update
                (previous, holders, step), (new, plans, missing) = rollback, older
                behind = ()
                self._undo_update(step)
        all_units = {_stage_key(k, self.n_stages, f): n for k, a in enumerate(self.stage_adapters)
                     for f, n in a.all_unit_counts().items()}
        source = _choose_source(missing, holders, reader, allow_init, all_units)
        with _phase(phases, "groups_s"):
            self._teardown()
            self.groups = self.group_cache.build(new, world, self.me)
        with _phase(phases, "transfer_s"):
            step, sent = self._load_state(source, plans[self.me.stage], new[self.me.stage], world, step, reader)
            self.undo = None  # every member is at ``step`` now
        with _phase(phases, "rebuild_s"):
            self.layout, self.stage_layouts, self.world = new[self.me.stage], new, world
            if self.state is not None:
                self._build_training()
        report = self._report(source, step, sent, previous, new, plans, holders, t0, phases, behind)
        log.info(
            "ntp plan applied member=%s source=%s step=%d units_moved=%d peer_units=%d bytes_moved=%d seconds=%.3f",
            tuple(self.me), source, step, report.units_moved, report.peer_units, report.bytes_moved, report.seconds,
        )
        return report

    def _plan_layouts(self, placements, previous, holders):
        """The new layout of every stage, the reshard plans from what ``holders`` hold, and
        the units (stage keys) that no holder has."""
        new = plan_stages([a.unit_counts for a in self.stage_adapters], placements, self.base_tp, previous,
                          holders, [a.derived for a in self.stage_adapters])
        plans = [plan_reshard(_stage(previous, k), lay, holders) for k, lay in enumerate(new)]
        missing = {_stage_key(k, self.n_stages, f): u for k, p in enumerate(plans) for f, u in p.missing.items()}
        return new, plans, missing

    def _undo_update(self, step: int) -> None:
        """Torn step: go back to the state before this member's last update (``step``)."""
        if self.state is not None and self.state.step == step + 1:
            assert self.undo is not None and self.undo.step == step
            log.warning("ntp torn step undone member=%s from_step=%d to_step=%d", tuple(self.me), step + 1, step)
            self.state, self.undo = self.undo, None

    def _validate(self, placements: tuple[ReplicaPlacement, ...]) -> None:
        """Typed errors before any collective: every replica places every stage once,
        each stage's placements fit the stage's families."""
        for k, ps in enumerate(split_stages(placements, self.n_stages)):
            validate_request(self.stage_adapters[k].unit_counts, ps, self.base_tp)

    def _report(self, source, step, sent, previous, new, plans, holders, t0, phases, behind) -> ReshardReport:
        """Whole job, every stage: what moved against the lower bound."""
        live = source == "live"
        lower = 0
        for k, lay in enumerate(new):
            units = lower_bound_units(_stage(previous, k), lay, holders) if live else lower_bound_units(None, lay, [])
            lower += sum(self.stage_unit_bytes[k][f] * n for f, n in units.items())
        return ReshardReport(
            source=source,
            step=step,
            units_moved=sum(len(p.transfers) for p in plans) if live else 0,
            peer_units=sum(p.peer_units() for p in plans) if live else 0,
            bytes_moved=sum(p.bytes_moved(self.stage_unit_bytes[k]) for k, p in enumerate(plans)) if live else 0,
            lower_bound_bytes=lower,
            bytes_sent=sent,
            seconds=time.perf_counter() - t0,
            phases=phases,
            layout=new[self.me.stage],
            behind=behind if live else (),
        )

    def _load_state(self, source, plan, new: JobLayout, world, step: int, reader) -> tuple[int, int]:
        """This member's state in the new layout; returns (step, bytes sent)."""
        mine = new.member(self.me)
        units = member_units(mine.units) if mine is not None else None
        device = device_for_backend()
        if source == "live":
            self.state, sent = execute_plan(plan, self.me, world, self.state, units, self.specs, step, device)
            return step, sent
        if source == "checkpoint":
            k, n = self.me.stage, self.n_stages
            fetch = lambda fam, u: reader.payload(_stage_key(k, n, fam), u)  # noqa: E731
            self.state = build_state(self.specs, units, reader.step, device, fetch) if units else None
            return reader.step, 0
        if units:
            initial = lambda spec, held: self.adapter.initial_local(spec, held, self.seed)  # noqa: E731
            self.state = init_local_state(self.specs, units, self.seed, device, initial)
        else:
            self.state = None
        return 0, 0

    def _agree(self):
        """Who holds state at the newest step, which step, and what each holds. Every
        member reports its own units, so an interrupted reshard (some members already in
        the new layout, others still in the old one) is resolved like any other start
        layout. Members left behind by a torn step (the failure hit between members'
        optimizer updates) count as holding nothing: their units are re-sent from
        up-to-date holders. Second: the same at the torn step's older step when the
        members ahead can undo their update (``torn.rollback_step``), else None; the
        caller uses it when some unit's newest copy is gone. Third: the members left behind."""
        gathered: list = [None] * dist.get_world_size()
        settings = (self.model_adapter.fingerprint(), self.n_stages, self.base_tp, self.bucket_bytes)
        mine = self.layout.member(self.me) if self.layout is not None and self.state is not None else None
        held = (mine.tp_rank, dict(mine.units)) if mine is not None else None
        undo = self.undo.step if self.undo is not None else None
        dist.all_gather_object(gathered, (tuple(self.me), held, self.step, undo, self.group_cache.intact(), settings))
        differing = sorted({tuple(m) for m, *_, other in gathered if other != settings})
        if differing:
            raise PlanError(
                f"members {differing} run another model config, stage count, base_tp or bucket size than "
                f"member {tuple(self.me)}: {[g[-1] for g in gathered]}"
            )
        if not all(g[4] for g in gathered):
            self.group_cache.abandon()  # someone lost its groups: everyone builds anew
        steps = {step for _, held, step, *_ in gathered if held is not None}
        if not steps:
            return (None, [], 0), None, ()
        newest = max(steps)
        if len(steps) > 1:
            log.warning("ntp torn step member=%s steps=%s newest_step=%d", tuple(self.me), sorted(steps), newest)
        reports = {Member(*m): held for m, held, step, *_ in gathered if held is not None and step == newest}
        behind = tuple(sorted(Member(*m) for m, held, step, *_ in gathered if held is not None and step != newest))
        older = torn.rollback_step({Member(*g[0]): (g[2], g[3]) for g in gathered if g[1] is not None})
        rollback = None
        if older is not None:
            everyone = {Member(*m): held for m, held, *_ in gathered if held is not None}
            rollback = (self._held_layout(everyone), list(everyone), older)
        return (self._held_layout(reports), list(reports), newest), rollback, behind

    def _held_layout(self, reports: Mapping[Member, tuple[int, dict]]) -> tuple[JobLayout, ...]:
        """Per stage, a layout describing what its holders hold (only members and units
        are used)."""
        out = []
        for k in sorted({m.stage for m in reports}):
            replicas = []
            for replica in sorted({m.replica for m in reports if m.stage == k}):
                members = sorted((m for m in reports if m.replica == replica and m.stage == k),
                                 key=lambda m: reports[m][0])
                layouts = tuple(MemberLayout(m, reports[m][0], False, reports[m][1]) for m in members)
                replicas.append(ReplicaLayout(replica, 1, layouts))
            families = tuple(self.stage_adapters[k].all_unit_counts().items())
            out.append(JobLayout(self.base_tp, families, 0, {}, tuple(replicas), k))
        return tuple(out)

    def _teardown(self) -> None:
        if self.sync is not None:
            self.sync.close()
        self.model = self.sync = self.pipe = None
        self.groups = NtpGroups()

    def _build_training(self) -> None:
        assert self.state is not None and self.layout is not None
        self.model = self.adapter.build(self.state.units, self.state.tensors["param"], self.groups.tp)
        params = self.model.params_in_spec_order()
        self.sync = GradSync(params, self.layout, self.me, self.world, self.groups, self.bucket_bytes)
        links = stage_links(self.stage_layouts, self.world, self.me)
        self.pipe = PipelineStep(self.model, links, self.groups.tp, self.layout.replica(self.me.replica).degree,
                                 self.model_adapter.hidden, self.train.dtype == "bf16")

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
        device = next(iter(self.state.tensors["param"].values())).device
        tokens, targets = tokens.to(device), targets.to(device)
        chunks = [(x, y) for x, y in zip(tokens.tensor_split(self.train.micro_batches),
                                         targets.tensor_split(self.train.micro_batches), strict=True)
                  if x.shape[0]]
        self.sync.begin(rep.local_batch / self.layout.global_batch, len(chunks))
        first = 0
        for r in self.layout.replicas:  # the replica's slice of the global batch (as the trainers cut it)
            if r.replica == self.me.replica:
                break
            first += r.local_batch
        self.pipe.dropout_at = (self.seed, self.step, first)
        local_loss = self.pipe.run(chunks, rep.local_batch)
        global_loss = self.sync.finish(local_loss)
        return self._clip_and_update(global_loss)

    def _clip_and_update(self, global_loss: float) -> float:
        """Clip by the global norm (computed once, the same on every member), AdamW at the
        scheduled learning rate of this step. Returns the global loss: with stages only
        the last stage has it, and the norm's all-reduce carries it to every stage."""
        if self.grad_scale != 1.0:
            self.sync.scale(self.grad_scale, sharded_only=True)
        if self.n_stages == 1:
            self.last_grad_norm = self.sync.grad_norm()
        else:
            carry = global_loss if self.pipe.links.last and self.sync.repl_counted else 0.0
            self.last_grad_norm, global_loss = self.sync.norm_and_sum(carry)
        if self.train.clip_grad > 0:
            coef = self.train.clip_grad / (self.last_grad_norm + 1e-6)
            self.sync.scale(min(coef, 1.0))
        lr = self.adam.lr * self.train.lr_factor(self.step)
        grads = {s.name: p.grad for s, p in self.model.params_in_spec_order()}
        self.fault.before_update(self.step)
        self.undo = torn.copy_state(self.state)  # until every member is past this update
        adam_step(self.state, grads, self.adam, lr=lr, decay=self.decay)
        return global_loss

    def confirm_step(self) -> None:
        """Call after a collective over every member of the job has succeeded in the next
        step (all of them are past the last update): the undo state is freed."""
        self.undo = None

    def rebind(self) -> ReshardReport:
        """Collective over a re-initialised default group whose processes all hold state in
        the current layout: rebuild the process groups for it (moves nothing). The world
        map is learned from the processes themselves."""
        if self.layout is None:
            raise PlanError("no layout yet: call start() first")
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, tuple(self.me))
        return self.apply_plan(self.placements(), {Member(*m): r for r, m in enumerate(gathered)})

    def placements(self) -> tuple[ReplicaPlacement, ...]:
        """The current layout's placements, every stage."""
        return tuple(p for lay in self.stage_layouts for p in lay.placements())

    def _rebind_for_step(self) -> None:
        """``train_step`` found groups of a destroyed default group. When the new default
        group is exactly the active members (all of them are in ``train_step`` now), they
        rebind together; otherwise the caller must call ``apply_plan``."""
        assert self.layout is not None
        if dist.get_world_size() != sum(len(lay.members()) for lay in self.stage_layouts):
            raise PlanError(
                "the default process group was re-initialised since the last plan and is not "
                "the plan's members: call apply_plan(placements, new_world) on every process"
            )
        log.info("ntp rebinding groups to a re-initialised default group member=%s", tuple(self.me))
        self.rebind()

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Collective over the active members: every stage's first replica writes its
        units, then the meta file marking the checkpoint complete (``persist``)."""
        persist.save_checkpoint(self, Path(path))

    def export_hf(self, path: str | os.PathLike, max_shard_bytes: int | None = None) -> list[str]:
        """Collective over the active members: write the model to ``path`` as a Hugging
        Face directory that ``from_pretrained`` loads; returns the files written (on the
        writer; [] elsewhere). See ``persist.export_hf``."""
        return persist.export_hf(self, Path(path), max_shard_bytes)

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
        """The end of this process's part in the job: lets its last contributions reach
        the peers (``collectives.flush_sends``), then destroys its NTP groups."""
        collectives.flush_sends()
        self._teardown()
        self.group_cache.close()
        self.state = self.undo = None
