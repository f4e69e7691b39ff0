"""`tpflex-train`: train a Hugging Face causal LM under nonuniform tensor parallelism on
this machine, with a schedule of layout changes, and no controller.

  tpflex-train --model DIR --data TOKENS.npy --out DIR --tp 4 --replicas 2 \\
      --events "5:drain=1:2,9:kill=0:3,12:undrain=1:2" --global-batch 8 --steps 20 \\
      --lr 3e-3 --min-lr-ratio 0.1 --warmup 3 --weight-decay 0.1 --clip-grad 1.0 \\
      --betas 0.9,0.95 --eps 1e-8 --micro-batches 1 --dtype fp32 --seed 0

It starts one process per slot (gloo on CPU; --backend nccl binds one GPU per process)
and acts as their plan source. Data: an integer array [N, seq_len + 1]; step s uses rows
(s*B + i) mod N for i < B, replica r takes its contiguous slice (replicas in order, the
global batch split evenly whatever their TP degrees); inputs row[:-1], labels row[1:]; the
loss is the mean over all predicted tokens of the global batch. LR at step s (0-based):
lr*(s+1)/warmup while s < warmup, then lr_min + (lr - lr_min)*(1 + cos(pi*(s - warmup) /
(steps - warmup)))/2 with lr_min = lr*min_lr_ratio. Events apply at the boundary before
their step: drain=R:S removes base-TP slot S of replica R (live reshard), undrain=R:S
returns it, kill=R:S SIGKILLs that rank's process during the step (the survivors recover
in-process from peers and re-run the step); a killed slot stays out until an undrain
returns it, as a fresh process that receives its units from peers. With --pp P each
replica is P pipeline stages of --tp slots (layers split in contiguous ranges, 1F1B over
the micro-batches) and a slot is R:K:S (replica, stage, slot): "5:drain=1:0:2". Writes
OUT/losses.json (losses, degrees, grad_norms per step) and the trained model in HF format
in OUT. Exit codes: 0 done, 1 the run failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import sys
import time
from datetime import timedelta
from pathlib import Path

from tpflex_trainer.ntp.errors import NtpError
from tpflex_trainer.ntp.layout import Member, validate_request
from tpflex_trainer.ntp.optim import AdamSettings, TrainSettings, WarmupCosine
from tpflex_trainer.ntp.stage_adapter import stage_view
from tpflex_trainer.ntp.stages import split_stages
from tpflex_trainer.train.data import DataError, load_tokens
from tpflex_trainer.train.schedule import ScheduleError, parse_events
from tpflex_trainer.train.worker import RunSpec, worker_entry


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpflex-train", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", required=True, help="Hugging Face model directory (config.json [+ safetensors])")
    a("--data", required=True, help="token ids, .npy integer array [N, seq_len + 1]")
    a("--out", required=True, help="output directory: losses.json and the trained model")
    a("--tp", type=int, default=4, help="base TP degree (slots per replica)")
    a("--replicas", type=int, default=2, help="data-parallel replicas")
    a("--pp", type=int, default=1, help="pipeline stages per replica (each its own TP domain of --tp slots)")
    a("--events", default="", help='layout changes, e.g. "5:drain=1:2,9:kill=0:3,12:undrain=1:2" '
      '(with --pp > 1 a slot is REPLICA:STAGE:SLOT, e.g. "5:drain=1:0:2")')
    a("--global-batch", type=int, default=8, help="samples per step over all replicas")
    a("--steps", type=int, default=20)
    a("--lr", type=float, default=3e-3, help="peak learning rate")
    a("--min-lr-ratio", type=float, default=0.1, help="final LR of the cosine as a fraction of --lr")
    a("--warmup", type=int, default=0, help="linear warmup steps")
    a("--weight-decay", type=float, default=0.0, help="AdamW decoupled weight decay (2+-dim parameters)")
    a("--clip-grad", type=float, default=0.0, help="max global gradient 2-norm (0: no clipping)")
    a("--betas", default="0.9,0.999", help="Adam betas, 'b1,b2'")
    a("--eps", type=float, default=1e-8)
    a("--micro-batches", type=int, default=1, help="gradient accumulation steps per replica")
    a("--dtype", default="fp32", help="fp32 or bf16 (autocast, fp32 master weights and state)")
    a("--seed", type=int, default=0, help="init seed (a model directory without weights)")
    a("--backend", default="gloo", help="gloo (CPU) or nccl (one GPU per process)")
    a("--collective-timeout", type=float, default=120.0, help="seconds before a collective gives up")
    a("--no-export", action="store_true", help="do not write the trained model")
    a("--threads", type=int, default=1, help="torch threads per process")
    return p


def _betas(p: argparse.ArgumentParser, text: str) -> tuple[float, float]:
    try:
        b1, b2 = (float(x) for x in text.split(","))
    except ValueError:
        p.error(f"--betas: need 'b1,b2', got {text!r}")
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        p.error(f"--betas: each must be within [0, 1), got {text!r}")
    return b1, b2


def _check_numbers(p: argparse.ArgumentParser, a) -> None:
    checks = [
        (a.tp >= 1, "--tp: must be >= 1"), (a.replicas >= 1, "--replicas: must be >= 1"),
        (a.pp >= 1, "--pp: must be >= 1"),
        (a.steps >= 1, "--steps: must be >= 1"),
        (a.global_batch >= a.replicas, "--global-batch: needs at least one sample per replica"),
        (a.lr > 0, "--lr: must be > 0"), (0 <= a.min_lr_ratio <= 1, "--min-lr-ratio: must be within [0, 1]"),
        (0 <= a.warmup < a.steps, "--warmup: must be within 0..steps-1"),
        (a.weight_decay >= 0, "--weight-decay: must be >= 0"), (a.clip_grad >= 0, "--clip-grad: must be >= 0"),
        (a.eps > 0, "--eps: must be > 0"), (a.micro_batches >= 1, "--micro-batches: must be >= 1"),
        (a.micro_batches <= a.global_batch // a.replicas, "--micro-batches: more than a replica's local batch"),
        (a.dtype in ("fp32", "bf16"), f"--dtype: must be fp32 or bf16, got {a.dtype!r}"),
        (a.backend in ("gloo", "nccl"), f"--backend: must be gloo or nccl, got {a.backend!r}"),
        (a.collective_timeout > 0, "--collective-timeout: must be > 0"), (a.threads >= 1, "--threads: must be >= 1"),
    ]
    for ok, why in checks:
        if not ok:
            p.error(why)


def build_spec(argv: list[str] | None) -> tuple[RunSpec, str]:
    """Parse and check everything before any process starts (exit 2 naming the argument)."""
    p = _parser()
    a = p.parse_args(argv)
    _check_numbers(p, a)
    betas = _betas(p, a.betas)
    try:
        from tpflex_trainer.ntp.hf_adapter import HfAdapter

        adapter = HfAdapter.from_pretrained_dir(a.model, a.tp)
    except (NtpError, OSError, ValueError) as exc:
        p.error(f"--model: {exc}")
    try:
        stage_counts = [stage_view(adapter, k, a.pp).unit_counts for k in range(a.pp)]
    except NtpError as exc:
        p.error(f"--pp: {exc}")
    try:
        sched = parse_events(a.events, a.tp, a.replicas, a.steps, a.global_batch, a.pp)
        for counts, placed in zip(stage_counts, split_stages(sched.placements(frozenset()), a.pp), strict=True):
            validate_request(counts, placed, a.tp)
    except ScheduleError as exc:
        p.error(f"--events: {exc}")
    except NtpError as exc:
        p.error(f"--tp: {exc}")
    try:
        load_tokens(a.data, adapter.vocab)
    except DataError as exc:
        p.error(f"--data: {exc}")
    out = Path(a.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        p.error(f"--out: cannot create {out}: {exc.strerror}")
    if a.backend == "nccl":
        import torch

        if torch.cuda.device_count() < a.tp * a.replicas * a.pp:
            p.error(f"--backend: nccl needs {a.tp * a.replicas * a.pp} GPUs, found {torch.cuda.device_count()}")
    train = TrainSettings(clip_grad=a.clip_grad, micro_batches=a.micro_batches, dtype=a.dtype,
                          schedule=WarmupCosine(a.steps, a.warmup, a.min_lr_ratio))
    adam = AdamSettings(lr=a.lr, betas=betas, eps=a.eps, weight_decay=a.weight_decay)
    spec = RunSpec(model=str(a.model), data=str(a.data), out=str(out), schedule=sched, adam=adam,
                   train=train, seed=a.seed, backend=a.backend, collective_timeout_s=a.collective_timeout,
                   export=not a.no_export, threads=a.threads, env=_self_test_env(adapter))
    return spec, str(adapter.config.model_type)


def _self_test_env(adapter) -> dict[str, str]:
    """The fidelity self-test ran here (``HfAdapter``): its result goes to the workers, bound
    to the config, so each rank does not run it again."""
    from tpflex_trainer.ntp.hf_selftest import PASSED_ENV, passed_token

    if adapter.fidelity is None:  # skipped: the workers skip it too, with the same warning
        return {}
    return {PASSED_ENV: passed_token(adapter.config, adapter.fidelity, adapter.plan.head_units)}


def main(argv: list[str] | None = None) -> int:
    spec, model_type = build_spec(argv)
    t0 = time.monotonic()
    result = Launcher(spec, model_type).run()
    if result.error:
        print(f"tpflex-train: the run failed: {result.error}", file=sys.stderr)
        return 1
    out = Path(spec.out) / "losses.json"
    out.write_text(json.dumps(result.summary(), indent=1))
    losses = result.summary()["losses"]
    print(f"tpflex-train: {len(losses)} steps in {time.monotonic() - t0:.1f}s, loss {losses[0]:.4f} -> "
          f"{losses[-1]:.4f}; wrote {out}" + ("" if not spec.export else f" and the model in {spec.out}"))
    return 0


class RunResult:
    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.records: dict[int, tuple] = {}
        self.seconds: dict[int, dict[int, float]] = {}
        self.sync_wait: dict[int, dict[int, float]] = {}  # time in the sync after backward
        self.reshards: list[dict] = []
        self.grad_bytes: dict[tuple[int, int], int] = {}
        self.digests: dict[tuple[int, int], dict[str, str]] = {}  # member -> unit -> digest
        self.export_s = 0.0
        self.error = ""

    def disagreeing_units(self) -> list[str]:
        """Units whose holders (all replicas, every copy) do not hold identical state."""
        seen: dict[str, set[str]] = {}
        for digests in self.digests.values():
            for unit, d in digests.items():
                seen.setdefault(unit, set()).add(d)
        return sorted(u for u, ds in seen.items() if len(ds) > 1)

    def summary(self) -> dict:
        rec = [self.records[s] for s in range(self.steps)]
        return {
            "losses": [r[0] for r in rec], "degrees": [r[2] for r in rec],
            "grad_norms": [r[1] for r in rec],
            "step_seconds": {str(r): [self.seconds.get(s, {}).get(r) for s in range(self.steps)]
                             for r in sorted({r for v in self.seconds.values() for r in v})},
            "sync_wait_s": {str(r): [self.sync_wait.get(s, {}).get(r) for s in range(self.steps)]
                            for r in sorted({r for v in self.sync_wait.values() for r in v})},
            "reshards": self.reshards,
            "units_checked": sum(len(d) for d in self.digests.values()),
            "units_disagreeing": self.disagreeing_units(),
        }


class Launcher:
    """Starts the processes, starts fresh ones for killed slots an undrain returns,
    gathers what they report."""

    def __init__(self, spec: RunSpec, model_type: str) -> None:
        import torch.distributed as dist

        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["torch", "torch.distributed", "tpflex_trainer.train.worker",
                                         "tpflex_trainer.ntp.hf_adapter",
                                         f"transformers.models.{model_type}.modeling_{model_type}"])
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=spec.collective_timeout_s))
        self.spec = RunSpec(**{**spec.__dict__, "store_port": self.store.port})
        self.results = self.ctx.Queue()
        self.procs: dict[Member, mp.Process] = {}
        sched = spec.schedule
        self.kills = [e for e in sched.events if e.kind == "kill"]
        self.revivals = [(e.step, e.member) for e in sched.events
                         if e.kind == "undrain" and e.member in sched.revived_at(e.step)]

    def _start(self, member: Member, join_at: int | None) -> None:
        proc = self.ctx.Process(target=worker_entry, args=(tuple(member), self.spec, self.results, join_at),
                                daemon=True)
        proc.start()
        self.procs[member] = proc

    def run(self) -> RunResult:
        sched = self.spec.schedule
        result = RunResult(sched.steps)
        for member in sched.members():
            self._start(member, None)
        killed: list[Member] = []
        quiet_limit = 2 * self.spec.collective_timeout_s + 60
        last = time.monotonic()
        try:
            while self.procs:
                try:
                    msg = self.results.get(timeout=0.2)
                    last = time.monotonic()
                    self._handle(msg, result)
                except queue.Empty:
                    pass
                if result.error:
                    break
                self._reap(killed, result)
                if time.monotonic() - last > quiet_limit:
                    result.error = f"no progress for {quiet_limit:.0f}s"
            while not result.error:  # what the last processes reported before exiting
                try:
                    self._handle(self.results.get(timeout=0.5), result)
                except queue.Empty:
                    break
        finally:
            for p in list(self.procs.values()):
                if p.is_alive():
                    p.kill()
                p.join(5)
        missing = [s for s in range(sched.steps) if s not in result.records]
        if not result.error and missing:
            result.error = f"steps {missing[:10]} have no loss"
        return result

    def _handle(self, msg: tuple, result: RunResult) -> None:
        kind = msg[0]
        if kind == "step":
            _, step, replica, loss, norm, degrees, seconds, sync_wait = msg
            result.records[step] = (loss, norm, degrees)  # a re-run step overwrites
            result.seconds.setdefault(step, {})[replica] = seconds
            result.sync_wait.setdefault(step, {})[replica] = sync_wait
        elif kind == "reshard":
            result.reshards.append({"member": list(msg[1]), "at": msg[2], **msg[3]})
        elif kind == "sync":  # bytes a member moves per step in its TP group, last layout
            result.grad_bytes[msg[1]] = msg[2]
        elif kind == "state":
            result.digests[msg[1]] = msg[2]
        elif kind == "export":
            result.export_s = max(result.export_s, msg[2])
        elif kind == "error":
            result.error = f"member {msg[1]}:\n{msg[2]}"

    def _drain_messages(self, result: RunResult, wait_s: float = 1.0) -> None:
        deadline = time.monotonic() + wait_s
        while not result.error and time.monotonic() < deadline:
            try:
                self._handle(self.results.get(timeout=0.1), result)
            except queue.Empty:
                continue

    def _reap(self, killed: list[Member], result: RunResult) -> None:
        """Exited processes: a scheduled victim is expected (its slot's fresh process
        starts now if an undrain returns it; it waits for that boundary); any other
        non-zero exit fails the run."""
        for member, proc in list(self.procs.items()):
            if proc.exitcode is None:
                continue
            del self.procs[member]
            scheduled = sum(1 for e in self.kills if e.member == member)
            if proc.exitcode != 0 and killed.count(member) < scheduled:
                killed.append(member)
                for i, (step, m) in enumerate(self.revivals):
                    if m == member:
                        self.revivals.pop(i)
                        self._start(member, step)
                        break
            elif proc.exitcode != 0 and not result.error:
                self._drain_messages(result)  # its traceback, when it sent one
                result.error = result.error or f"member {tuple(member)} exited with code {proc.exitcode}"

def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
