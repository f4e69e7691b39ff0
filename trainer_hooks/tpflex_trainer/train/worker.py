"""One process of a ``tpflex-train`` run: a member (replica, slot) training with the NTP
runtime and following the schedule.

Every process knows the whole schedule, so each change is a deterministic rendezvous:
* a boundary (drain/undrain) before step b: every live process calls ``apply_plan`` with
  the new placements (idle, drained members too: they hand over or receive units); when
  an undrain returns a killed slot, everyone first joins a new default group ``u<b>``
  with the fresh process;
* a kill during step k: the victim SIGKILLs itself in the middle of backward; the
  survivors' collectives fail, they abort their groups, tell idle members through the
  store (``fail/<k>``), join a new default group ``k<k>`` without the victim, recover the
  victim's units from peers (``apply_plan``) and re-run the step the runtime reports.
Idle members wait on the store (no collective pending) for the next boundary, a
recovery, or the end of the run.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from tpflex_trainer.ntp.errors import NtpError
from tpflex_trainer.ntp.groups import device_for_backend
from tpflex_trainer.ntp.layout import Member
from tpflex_trainer.ntp.optim import AdamSettings, TrainSettings
from tpflex_trainer.train.data import load_tokens, replica_batch
from tpflex_trainer.train.schedule import Schedule

log = logging.getLogger(__name__)
POLL_S = 0.02


@dataclass(frozen=True)
class RunSpec:
    model: str
    data: str
    out: str
    schedule: Schedule
    adam: AdamSettings
    train: TrainSettings
    seed: int = 0
    backend: str = "gloo"
    store_port: int = 0
    collective_timeout_s: float = 120.0
    export: bool = True
    threads: int = 1
    env: dict[str, str] = field(default_factory=dict)


class TrainWorker:
    def __init__(self, me: Member, spec: RunSpec, results) -> None:
        from tpflex_trainer.ntp.runtime import NtpRuntime

        self.me, self.spec, self.results = me, spec, results
        self.sched = spec.schedule
        self.timeout = timedelta(seconds=spec.collective_timeout_s)
        self.store = dist.TCPStore("127.0.0.1", spec.store_port, is_master=False, timeout=self.timeout)
        self.rt = NtpRuntime(spec.model, self.sched.tp, me, adam=spec.adam, seed=spec.seed,
                             train=spec.train, timeout=self.timeout, stages=self.sched.pp)
        self.data = load_tokens(spec.data, self.rt.adapter.vocab)
        self.world: tuple[Member, ...] = ()
        self.recovered: set[int] = set()
        self.done_boundaries: set[int] = set()

    # ------------------------------------------------------------------ groups
    def _join(self, epoch: str, world: tuple[Member, ...]) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.world = tuple(sorted(world))
        dist.init_process_group(
            self.spec.backend, store=dist.PrefixStore(epoch, self.store),
            rank=self.world.index(self.me), world_size=len(self.world), timeout=self.timeout)

    def _wmap(self) -> dict[Member, int]:
        return {m: i for i, m in enumerate(self.world)}

    def _report(self, kind: str, report) -> None:
        self.results.put(("reshard", tuple(self.me), kind, {
            "source": report.source, "step": report.step, "units_moved": report.units_moved,
            "peer_units": report.peer_units, "bytes_moved": report.bytes_moved,
            "lower_bound_bytes": report.lower_bound_bytes, "bytes_sent": report.bytes_sent,
            "seconds": report.seconds, "phases": dict(report.phases), "device": str(device_for_backend()),
            "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER", "")}))

    # ------------------------------------------------------------------ changes
    def start(self, join_at: int | None) -> int:
        if join_at is not None:  # a fresh process for a slot returned at boundary join_at
            self._wait_for(f"b/{join_at}")
            self._boundary(join_at)
            return join_at
        self._join("start", self.sched.alive_at(0))
        report = self.rt.start(self.sched.placements(self.sched.out_at(0)), self._wmap())
        self._report("start", report)
        return 0

    def _boundary(self, b: int) -> None:
        if self.sched.revived_at(b):
            self._join(f"u{b}", self.sched.alive_at(b))
        report = self.rt.apply_plan(self.sched.placements(self.sched.out_at(b)), self._wmap())
        self.done_boundaries.add(b)
        self._report(f"boundary {b}", report)

    def _wait_for(self, key: str) -> None:
        deadline = time.monotonic() + 10 * self.spec.collective_timeout_s
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"member {tuple(self.me)}: {key} not reached")
            time.sleep(POLL_S)

    def _pending_kill(self, step: int) -> int | None:
        kills = [e.step for e in self.sched.events
                 if e.kind == "kill" and e.step <= step and e.step not in self.recovered]
        return max(kills) if kills else None

    def _recover(self, k: int) -> int:
        """The kill of step k happened: rejoin without the victims, recover their units."""
        self.store.set(f"fail/{k}", "1")  # idle members join the recovery too
        self.rt.abort()
        self._join(f"k{k}", self.sched.alive_at(k, after_kills=True))
        report = self.rt.apply_plan(self.sched.placements(self.sched.out_after_kills(k)), self._wmap())
        self.recovered.add(k)
        self._report(f"recovery {k}", report)
        return report.step

    # ------------------------------------------------------------------ loop
    def run(self, join_at: int | None) -> None:
        step = self.start(join_at)
        while step < self.sched.steps:
            if step in self.sched.boundaries() and step not in self.done_boundaries:
                if self.rt.active:
                    self.store.set(f"b/{step}", "1")
                self._boundary(step)
            if not self.rt.active:
                step = self._idle(step)
                continue
            failed = self._step(step)
            if failed is None:
                step += 1
                continue
            k = self._pending_kill(step)
            if k is None:
                raise RuntimeError(f"member {tuple(self.me)}: step {step} failed with no kill scheduled: {failed}")
            step = self._recover(k)
        self._finish()

    def _step(self, step: int) -> str | None:
        rt = self.rt
        rep = rt.layout.replica(self.me.replica)
        batches = [r.local_batch for r in rt.layout.replicas]
        index = [r.replica for r in rt.layout.replicas].index(self.me.replica)
        inputs, labels = replica_batch(self.data, step, batches, index)
        if self.me in self.sched.kills_at(step) and step not in self.recovered:
            _arm_self_kill(rt)
        t0 = time.perf_counter()
        try:
            loss = rt.train_step(inputs, labels)
        except NtpError:
            raise
        except (RuntimeError, dist.DistError) as exc:
            return f"{type(exc).__name__}: {str(exc)[:200]}"
        seconds = time.perf_counter() - t0
        if rep.members[0].member == self.me and self.me.stage == 0:
            self.results.put(("step", step, self.me.replica, loss, rt.last_grad_norm,
                              degrees(rt), seconds, rt.sync.finish_seconds))
        return None

    def _idle(self, step: int) -> int:
        """Wait (no collective pending) for the next boundary, a recovery, or the end."""
        later = [b for b in self.sched.boundaries() if b > step or (b == step and b not in self.done_boundaries)]
        nxt = later[0] if later else None
        while True:
            k = self._next_kill_signalled(nxt)
            if k is not None:
                self._recover(k)
                if self.rt.active:
                    return k
                continue
            if nxt is not None and self.store.check([f"b/{nxt}"]):
                return nxt
            if self.store.check(["done"]):
                return self.sched.steps
            time.sleep(POLL_S)

    def _next_kill_signalled(self, before: int | None) -> int | None:
        for e in self.sched.events:
            if (e.kind == "kill" and e.step not in self.recovered
                    and (before is None or e.step < before) and self.store.check([f"fail/{e.step}"])):
                return e.step
        return None

    def _finish(self) -> None:
        if self.rt.active:
            sync = self.rt.sync
            self.results.put(("sync", tuple(self.me), sync.moved_bytes(), degrees(self.rt)))
            self.results.put(("state", tuple(self.me), unit_digests(self.rt)))
            if self.spec.export and self.spec.out:
                t0 = time.perf_counter()
                self.rt.export_hf(self.spec.out)
                self.results.put(("export", tuple(self.me), time.perf_counter() - t0))
            lead = self.rt.layout.replicas[0].members[0].member == self.me and self.me.stage == 0
            if lead:
                self.store.set("done", "1")
        self.results.put(("done", tuple(self.me)))
        self.rt.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def degrees(rt) -> list:
    """Per replica its TP degree, or with stages the list of its stages' degrees."""
    if rt.n_stages == 1:
        return [r.degree for r in rt.layout.replicas]
    return [[lay.replica(r.replica).degree for lay in rt.stage_layouts] for r in rt.layout.replicas]


def unit_digests(rt) -> dict[str, str]:
    """A digest of every unit this member holds (weights and Adam moments, bit for bit):
    replicas, and copies of a replicated unit, must agree exactly."""
    import hashlib

    from tpflex_trainer.ntp.state import unit_payload

    out = {}
    stage = f"stage{rt.me.stage}." if rt.n_stages > 1 else ""
    for fam, units in rt.state.units.items():
        for u in units:
            payload = unit_payload(rt.state, rt.specs, fam, u).detach().cpu().contiguous()
            out[f"{stage}{fam}:{u}"] = hashlib.sha256(payload.numpy().tobytes()).hexdigest()[:16]
    return out


def _arm_self_kill(rt) -> None:
    """SIGKILL this process from inside backward (the first gradient of the step)."""
    _, param = rt.model.params_in_spec_order()[-1]
    param.register_post_accumulate_grad_hook(lambda _p: os.kill(os.getpid(), signal.SIGKILL))


def worker_entry(me: tuple[int, ...], spec: RunSpec, results, join_at: int | None) -> None:
    """Process entry point (forkserver child)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    os.environ.update(spec.env)
    torch.set_num_threads(spec.threads)
    member = Member(*me)
    try:
        if spec.backend == "nccl":
            sched = spec.schedule
            torch.cuda.set_device((member.replica * sched.pp + member.stage) * sched.tp + member.slot)
        TrainWorker(member, spec, results).run(join_at)
    except BaseException:  # reported to the launcher with its traceback
        results.put(("error", tuple(me), traceback.format_exc()))
        raise SystemExit(1) from None
