"""The schedule of layout changes of a ``tpflex-train`` run: pure, no torch.

``--events "5:drain=1:2,9:kill=0:3,12:undrain=1:2"``: at the boundary before step 5
slot 2 of replica 1 is drained (a planned, live reshard); during step 9 the process of
replica 0 slot 3 is SIGKILLed (the survivors recover in-process from peers and re-run the
step); before step 12 slot 2 of replica 1 returns. A killed slot stays out until an
``undrain`` returns it (a fresh process that receives its units from peers). With
pipeline stages (``--pp P``, P > 1) a slot is ``REPLICA:STAGE:SLOT``
(``"5:drain=1:0:2"``: slot 2 of stage 0 of replica 1); only that stage's degree changes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tpflex_trainer.ntp.layout import Member, ReplicaPlacement

KINDS = ("drain", "undrain", "kill")
_EVENT = re.compile(r"^\s*(\d+)\s*:\s*(drain|undrain|kill)\s*=\s*(\d+)\s*:\s*(\d+)\s*(?::\s*(\d+)\s*)?$")


class ScheduleError(ValueError):
    """A malformed or impossible ``--events`` value; the message says which event."""


@dataclass(frozen=True)
class Event:
    step: int
    kind: str
    member: Member


@dataclass(frozen=True)
class Schedule:
    tp: int
    replicas: int
    steps: int
    global_batch: int
    events: tuple[Event, ...]
    pp: int = 1  # pipeline stages per replica

    def out_at(self, step: int) -> frozenset[Member]:
        """Slots out of the layout during ``step``: drained or killed before it (a kill
        during ``step`` itself counts from the recovery on: see ``out_after_kills``)."""
        out: set[Member] = set()
        for e in self.events:
            if e.step > step or (e.kind == "kill" and e.step == step):
                continue
            (out.discard if e.kind == "undrain" else out.add)(e.member)
        return frozenset(out)

    def kills_at(self, step: int) -> tuple[Member, ...]:
        return tuple(e.member for e in self.events if e.kind == "kill" and e.step == step)

    def out_after_kills(self, step: int) -> frozenset[Member]:
        return self.out_at(step) | set(self.kills_at(step))

    def placements(self, out: frozenset[Member]) -> tuple[ReplicaPlacement, ...]:
        """Every replica with its remaining slots; the global batch is split over the
        replicas in order (sizes differ by at most one), whatever their degrees."""
        sizes = [self.global_batch // self.replicas + (1 if r < self.global_batch % self.replicas else 0)
                 for r in range(self.replicas)]
        return tuple(
            ReplicaPlacement(r, tuple(s for s in range(self.tp) if Member(r, s, k) not in out), sizes[r], k)
            for r in range(self.replicas)
            for k in range(self.pp)
        )

    def boundaries(self) -> list[int]:
        """Steps before which drains/undrains apply, ascending."""
        return sorted({e.step for e in self.events if e.kind != "kill"})

    def revived_at(self, step: int) -> tuple[Member, ...]:
        """Killed slots returned by an undrain at ``step``: fresh processes join there."""
        dead: set[Member] = set()
        for e in self.events:
            if e.step >= step:
                break
            if e.kind == "kill":
                dead.add(e.member)
            elif e.kind == "undrain":
                dead.discard(e.member)
        return tuple(e.member for e in self.events
                     if e.step == step and e.kind == "undrain" and e.member in dead)

    def alive_at(self, step: int, after_kills: bool = False) -> tuple[Member, ...]:
        """Processes alive at the boundary before ``step`` (revived ones included), or
        after the kills of ``step`` when ``after_kills``."""
        dead: set[Member] = set()
        for e in self.events:
            if e.step > step or (e.step == step and e.kind == "kill" and not after_kills):
                continue
            if e.kind == "kill":
                dead.add(e.member)
            elif e.kind == "undrain":
                dead.discard(e.member)
        return tuple(m for m in self.members() if m not in dead)

    def members(self) -> tuple[Member, ...]:
        """Every slot of the job (replica, stage, slot order)."""
        return tuple(Member(r, s, k) for r in range(self.replicas) for k in range(self.pp) for s in range(self.tp))

    def name(self, m: Member) -> str:
        """A slot as events write it: R:S, or R:K:S with stages."""
        return f"{m.replica}:{m.slot}" if self.pp == 1 else f"{m.replica}:{m.stage}:{m.slot}"


def parse_events(text: str, tp: int, replicas: int, steps: int, global_batch: int, pp: int = 1) -> Schedule:
    """Parse and check ``--events``; raises ``ScheduleError`` naming the bad event."""
    events = []
    form = "REPLICA:SLOT" if pp == 1 else "REPLICA:STAGE:SLOT"
    for raw in [p for p in (text or "").split(",") if p.strip()]:
        m = _EVENT.match(raw)
        if m is None or (m[5] is None) != (pp == 1):
            raise ScheduleError(f"{raw.strip()!r} is not STEP:drain|undrain|kill={form}")
        step, kind, r = int(m[1]), m[2], int(m[3])
        k, s = (0, int(m[4])) if pp == 1 else (int(m[4]), int(m[5]))
        if not 0 < step < steps:
            raise ScheduleError(f"{raw.strip()!r}: step must be within 1..{steps - 1}")
        if not (0 <= r < replicas and 0 <= s < tp and 0 <= k < pp):
            raise ScheduleError(f"{raw.strip()!r}: no replica {r} stage {k} slot {s} "
                                f"(replicas {replicas}, pp {pp}, tp {tp})")
        events.append(Event(step, kind, Member(r, s, k)))
    order = {"drain": 0, "undrain": 0, "kill": 1}  # at one step: boundary changes, then kills
    events.sort(key=lambda e: (e.step, order[e.kind]))
    sched = Schedule(tp, replicas, steps, global_batch, tuple(events), pp)
    _check(sched)
    return sched


def _check(sched: Schedule) -> None:
    out: set[Member] = set()
    for e in sched.events:
        where = f"{e.step}:{e.kind}={sched.name(e.member)}"
        if e.kind == "undrain":
            if e.member not in out:
                raise ScheduleError(f"{where}: the slot is not out (drain or kill it first)")
            out.discard(e.member)
            continue
        if e.member in out:
            raise ScheduleError(f"{where}: the slot is already out")
        out.add(e.member)
        if all(Member(e.member.replica, s, e.member.stage) in out for s in range(sched.tp)):
            stage = f" stage {e.member.stage}" if sched.pp > 1 else ""
            raise ScheduleError(f"{where}: replica {e.member.replica}{stage} would have no slot left")
    kills = [e for e in sched.events if e.kind == "kill"]
    if kills and sched.replicas < 2:
        raise ScheduleError("kill needs --replicas >= 2: a killed rank's units come from another replica")
