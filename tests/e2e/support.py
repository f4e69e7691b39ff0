"""Helpers of the end-to-end tests: free demo port ranges, etcd history, loss parity."""

from __future__ import annotations

import threading
from pathlib import Path

from tpflex_proto import codec, keys, planstore, types_pb2
from tpflex_proto.etcd import Etcd
from tpflex_trainer.demo.data import global_batch
from tpflex_trainer.demo.model import DEMO_ADAM, DEMO_MODEL, DEMO_SEED
from tpflex_trainer.ntp.reference import reference_losses

from tests.support import ports

N_AGENTS = 2
# a story phase's limit: longer than the trainers' watchdog (30 s, half the 60 s collective
# timeout) plus a recovery. With gloo, a survivor blocked in a collective whose peers are
# all survivors (also blocked) has no closed socket to learn of the death from; its
# watchdog ends the wait, and the restart epoch it reports brings the next round.
PHASE_S = 100.0


def free_base_port() -> int:
    """A free port range for the demo cluster (``N_AGENTS`` agents)."""
    return ports.free_base_port(N_AGENTS)


def etcd_history(etcd: Etcd, prefix: str, message_type, timeout: float = 10.0) -> list:
    """Every value ever put under ``prefix`` (decoded), in revision order: a watch from
    revision 1 replays the history (nothing here compacts etcd). For ``Plan``, the whole
    plans of the job whose plan key ``prefix`` is (headers and parts, planstore)."""
    job = keys.parse(prefix).name if message_type is types_pb2.Plan else ""
    if message_type is types_pb2.Plan:
        prefix = keys.job_prefix(job)
    kvs, _ = etcd.get_prefix(prefix)
    last = max((kv.mod_revision for kv in kvs), default=0)
    events: list = []
    replayed = threading.Event()

    def collect(batch) -> None:
        events.extend(batch)
        if batch[-1].mod_revision >= last:
            replayed.set()

    watch = etcd.watch_prefix(prefix, collect, start_revision=1)
    try:
        if last and not replayed.wait(timeout):
            raise TimeoutError(f"etcd history of {prefix} not replayed within {timeout}s")
    finally:
        watch.cancel()
    events = [e for e in events if e.mod_revision <= last]
    if message_type is types_pb2.Plan:  # a job's plans: headers and parts (planstore)
        folder = planstore.JobPlans(job)
        plans = (folder.fold(e.key, e.value, e.kind == "delete") for e in events)
        return [p for p in plans if p is not None]
    return [codec.decode(message_type, e.value, e.key) for e in events if e.kind == "put"]


def reference_for(global_batches: dict[int, int]) -> dict[int, float]:
    """Single-process reference losses for steps 0..max, each step on its global batch
    (``step -> samples``, as the job ran it)."""
    steps = sorted(global_batches)
    assert steps == list(range(len(steps))), f"steps missing: {set(range(steps[-1] + 1)) - set(steps)}"
    batches = [global_batch(DEMO_MODEL, s, global_batches[s]) for s in steps]
    losses = reference_losses(DEMO_MODEL, DEMO_SEED, batches, lr=DEMO_ADAM.lr,
                              betas=DEMO_ADAM.betas, eps=DEMO_ADAM.eps)
    return dict(zip(steps, losses, strict=True))


def phase_report(summary, workdir: Path, lines: int = 16, stack_lines: int = 90) -> str:
    """An e2e test's message when a phase took too long: the phases, then the last lines of
    every rank's log (the story's ranks log at INFO in these tests: what each did when).
    A rank whose collectives hung (its log has thread stacks) comes last, where a cut
    report still shows it, with the stacks it dumped."""
    out = [f"phases after the failure: {summary.phases_failure}",
           f"phases after the repair: {summary.phases_repair}"]

    def stuck(log: Path) -> tuple[bool, str]:
        return "thread stacks follow" in log.read_text(errors="replace"), log.name

    for log in sorted(Path(workdir).glob("rank-*.log"), key=stuck):
        text = log.read_text(errors="replace").splitlines()
        starts = [i for i, line in enumerate(text) if "thread stacks follow" in line]
        stacks = [line for i in starts[:2] for line in text[i:i + stack_lines]]
        out += [f"--- {log.name}", *text[-lines:], *(["--- its thread stacks"] if stacks else []), *stacks]
    return "\n".join(out)


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)
