"""The chaos soak's same-layout reference: the chaos run's layouts, replayed without faults.

An XID 79 changes the job's layout (the degraded replica runs at TP 3 on fewer samples
until its GPU is back), and the float reductions of another layout differ from a
fixed-layout run's. To measure what the *faults* cost, ``bench/soak.py`` replays the chaos
run: 8 gloo processes drive ``NtpRuntime`` directly (no control plane, no faults) through
the rounds the chaos run applied, in order, each from the step the chaos run resumed at,
with that round's plan (recorded by the soak from etcd) and with the members whose process
was new in that round (a restarted rank) starting empty, as they did in the chaos run, so
the runtime computes the same unit layouts from the same holders. Each step trains on
``global_batch(step, layout.global_batch)`` split by replica as the hooks do; the replay
checks that every step's global batch equals the chaos run's.

Pure part: :func:`rounds_from` (records + plans -> rounds); the run: :func:`replay`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from tpflex_proto import types_pb2


class ReplayUnsupported(RuntimeError):
    """The chaos run did something a replay cannot reproduce or must not vouch for (a
    checkpoint restart, a plan generation the soak did not record, lost steps)."""


@dataclass(frozen=True)
class Round:
    step: int  # the chaos run resumed here in this round
    end: int  # and trained up to (not including) this step in it
    generation: int
    plan: bytes  # the serialized Plan of ``generation``
    fresh: tuple[int, ...]  # spec ranks without usable state in this round (``rounds_from``)
    epoch: int = 0  # the plan's restart epoch: the round is (generation, epoch)


def rounds_from(records: list[dict], plans: dict[int, types_pb2.Plan], stop: int) -> list[Round]:
    """The rounds the chaos run applied (one per (generation, restart epoch), in the order
    applied), with the spec ranks that started them without usable state: a new process,
    or a member a torn step left a step behind (its last collective failed, others applied
    the update; the runtime counts it as holding nothing when the newest copy of every unit
    survives, re-sends it its units, and plans the layout without it). Raises
    :class:`ReplayUnsupported` for a checkpoint restart or an unrecorded plan. Pure."""
    applied: dict[tuple[int, int], list[dict]] = {}
    for r in records:
        if r["kind"] == "applied" and r["source"] != "idle":
            applied.setdefault((r["generation"], r.get("epoch", 0)), []).append(r)
    order = sorted(applied, key=lambda k: min(r.get("at", r["t"]) for r in applied[k]))
    done = _steps_done(records)
    recorded = sorted((r["t"], r["step"]) for r in records if r["kind"] == "step")
    last: dict[int, tuple[int, int]] = {}  # rank -> (pid, step) of its last applied round
    rounds: list[tuple[int, tuple[int, int], tuple[int, ...]]] = []
    for key in order:
        recs = applied[key]
        if any(r["source"] == "checkpoint" for r in recs):
            raise ReplayUnsupported(f"round {key} loaded a checkpoint")
        steps = {r["step"] for r in recs}
        if len(steps) != 1:
            raise ReplayUnsupported(f"round {key}: members resumed at steps {sorted(steps)}")
        if key[0] not in plans:
            raise ReplayUnsupported(f"plan generation {key[0]} was not recorded")
        step = steps.pop()
        at = min(r.get("at", r["t"]) for r in recs)
        furthest = max((st for t, st in recorded if t < at), default=-1)
        if step < furthest:  # a torn step resumes at the newest step recorded, or after it
            raise ReplayUnsupported(f"round {key} resumed at step {step}, below step {furthest} that the job had "
                                    "already run: completed steps were lost (a restart from scratch?)")
        fresh = []
        for r in recs:
            pid, applied_step = last.get(r["rank"], (None, 0))
            if pid != r["pid"]:
                fresh.append(r["rank"])  # a new process
            elif max(applied_step, done(r["rank"], r["pid"], r["t"])) == step - 1:
                fresh.append(r["rank"])  # one step behind (a torn step): its state was not used
        last.update({r["rank"]: (r["pid"], step) for r in recs})
        rounds.append((step, key, tuple(sorted(fresh))))
    out = []
    for i, (step, (generation, epoch), fresh) in enumerate(rounds):
        end = rounds[i + 1][0] if i + 1 < len(rounds) else stop
        if end < step:
            raise ReplayUnsupported(f"the round after step {step} went back to step {end}")
        out.append(Round(step, end, generation, plans[generation].SerializeToString(), fresh, epoch))
    return out


def _steps_done(records: list[dict]):
    """``done(rank, pid, t)``: the step the process's state was at after the steps it
    recorded before time ``t`` (its newest recorded step + 1; 0 when none)."""
    per: dict[tuple[int, int], tuple[list[float], list[int]]] = {}
    for r in sorted((r for r in records if r["kind"] == "step"), key=lambda r: r["t"]):
        times, best = per.setdefault((r["rank"], r["pid"]), ([], []))
        times.append(r["t"])
        best.append(max(r["step"] + 1, best[-1] if best else 0))

    def done(rank: int, pid: int, t: float) -> int:
        times, best = per.get((rank, pid), ([], []))
        i = bisect.bisect_left(times, t)
        return best[i - 1] if i else 0
    return done


def one_layout(rounds: list[Round]) -> bool:
    """Every round used the same placements (then the fixed-layout run is the replay)."""
    def placements(r: Round):
        plan = types_pb2.Plan.FromString(r.plan)
        return sorted((rep.index, rep.tp_degree, tuple((g.node, g.index) for st in rep.stages for g in st.gpus))
                      for rep in plan.replicas)
    return len({repr(placements(r)) for r in rounds}) == 1


def _batches_of(records: list[dict]) -> dict[int, int]:
    return {r["step"]: r["global_batch"] for r in records if r["kind"] == "step"}


def replay(spec: types_pb2.JobSpec, rounds: list[Round], batches: dict[int, int], final_dir: Path,
           timeout_s: float = 3600.0, digest_dir: Path | None = None) -> None:
    """Run the rounds in 8 gloo processes; the final state goes to ``final_dir``. With
    ``digest_dir``, each rank writes there (``rank<N>.jsonl``) the digest of the state each
    round's first step starts from (``state_digest``), as the demo worker does."""
    import torch.distributed as dist

    from tests.support.ports import free_port
    from tests.trainer.harness import run_workers

    n = sum(len(st.ranks) for rep in spec.replicas for st in rep.stages)
    port = free_port()
    # the rounds' store lives here: a worker that finishes first must not take it along
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=600))
    try:
        run_workers(_worker, n, (spec.SerializeToString(), rounds, batches, str(final_dir), port,
                                       str(digest_dir) if digest_dir else ""),
                    timeout_s=timeout_s)
    finally:
        del store


def _worker(rank: int, world_size: int, spec_bytes: bytes, rounds: list[Round], batches: dict[int, int],
            final_dir: str, port: int, digest_dir: str = "") -> int:
    import json

    import torch.distributed as dist
    from tpflex_trainer.demo.data import global_batch
    from tpflex_trainer.demo.model import DEMO_ADAM, DEMO_MODEL, DEMO_SEED
    from tpflex_trainer.hooks.plans import spec_ranks
    from tpflex_trainer.ntp.layout import Member
    from tpflex_trainer.ntp.plan_adapter import placements_from_plan
    from tpflex_trainer.ntp.runtime import NtpRuntime
    from tpflex_trainer.ntp.state import state_digest

    spec = types_pb2.JobSpec.FromString(spec_bytes)
    me = spec_ranks(spec)[rank][0]
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=600))
    dist.destroy_process_group()  # the harness's group: each round forms its own
    runtime: NtpRuntime | None = None
    for k, rnd in enumerate(rounds):
        placements = placements_from_plan(types_pb2.Plan.FromString(rnd.plan), spec)
        members = sorted(Member(p.replica, s, p.stage) for p in placements for s in p.slots)
        if me not in members:
            continue
        if runtime is None or rank in rnd.fresh:
            if runtime is not None:
                runtime.close()
            runtime = NtpRuntime(DEMO_MODEL, spec.base_tp, me, adam=DEMO_ADAM, seed=DEMO_SEED,
                                 timeout=timedelta(seconds=120))
        world = {m: i for i, m in enumerate(members)}
        dist.init_process_group("gloo", store=dist.PrefixStore(f"round{k}/", store), rank=world[me],
                                world_size=len(world), timeout=timedelta(seconds=120))
        if runtime.layout is None:
            runtime.start(placements, world)
        else:
            runtime.apply_plan(placements, world)
        if runtime.step != rnd.step:
            raise RuntimeError(f"round {k}: the replay is at step {runtime.step}, the chaos run resumed at {rnd.step}")
        if digest_dir and runtime.state is not None and rnd.end > rnd.step:
            with open(Path(digest_dir) / f"rank{rank}.jsonl", "a") as f:
                f.write(json.dumps({"rank": rank, "generation": rnd.generation, "epoch": rnd.epoch, "step": rnd.step,
                                    "units": {u: list(v) for u, v in runtime.state.units.items()},
                                    "digest": state_digest(runtime.state)}) + "\n")
        for step in range(rnd.step, rnd.end):
            layout = runtime.layout
            if batches.get(step, layout.global_batch) != layout.global_batch:
                raise RuntimeError(f"step {step}: global batch {layout.global_batch}, the chaos run's {batches[step]}")
            tokens, targets = global_batch(DEMO_MODEL, step, layout.global_batch)
            offset = 0
            for rep in layout.replicas:
                if rep.replica == me.replica:
                    break
                offset += rep.local_batch
            local = layout.replica(me.replica).local_batch
            runtime.train_step(tokens[offset:offset + local], targets[offset:offset + local])
            runtime.confirm_step()
        if k == len(rounds) - 1:
            runtime.save_checkpoint(final_dir)
        runtime.abort()
        dist.destroy_process_group()
    return runtime.step if runtime is not None else -1
