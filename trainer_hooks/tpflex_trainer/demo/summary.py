"""The demo's summary: phase timings, throughput per phase, loss parity with a
single-process reference, and what dp-drop would have lost. Computed from a StoryRun."""

from __future__ import annotations

from dataclasses import dataclass

from tpflex_trainer.demo.model import DemoModel, demo_model
from tpflex_trainer.demo.story import StoryRun, format_degrees

# Bounds each phase must stay within on this class of machine (2 CPU cores); the e2e test
# checks them. Failure -> ... is measured from the XID injection.
PHASE_BOUNDS_S = {
    "detection": 2.0,
    "plan_commit": 3.0,
    "power_applied": 5.0,
    "reshard": 20.0,
    "first_step_after": 30.0,
}


@dataclass(frozen=True)
class Summary:
    phases_failure: dict[str, float]  # seconds from the XID injection
    phases_repair: dict[str, float]  # seconds from the repair
    throughput: dict[str, float]  # samples/s: before, during, after
    steps: int
    parity_max_rel_diff: float
    generations: list[int]
    degrees_by_generation: dict[int, list]  # per replica its degree (or its stages' degrees)
    dp_drop_ratio: float
    ntp_pw_ratio: float

    def violations(self) -> list[str]:
        out = []
        for name, value in self.phases_failure.items():
            bound = PHASE_BOUNDS_S.get(name)
            if bound is not None and not 0 <= value <= bound:
                out.append(f"{name} took {value:.3f}s (bound {bound}s)")
        return out


def _event_phases(run: StoryRun, generation: int, since: float) -> dict[str, float]:
    out: dict[str, float] = {}
    for ev in run.events:
        if ev.generation == generation:
            for p in ev.phases:
                out[p.phase] = p.at - since
    return out


def _step_table(run: StoryRun) -> dict[int, dict]:
    """step -> its last record (every active rank reports the same global loss). The last:
    a step re-run after a roll-back to a checkpoint (a torn step) may have run at another
    global batch the first time, and the job's trajectory is the re-run's."""
    table: dict[int, dict] = {}
    for r in sorted((r for r in run.records if r["kind"] == "step"), key=lambda r: r["t"]):
        table[r["step"]] = r
    return table


def phase_timings(run: StoryRun, generation: int, since: float) -> dict[str, float]:
    ev = _event_phases(run, generation, since)
    applied = [r for r in run.records if r["kind"] == "applied" and r["generation"] == generation]
    steps = [r for r in run.records if r["kind"] == "step" and r["generation"] == generation]
    phases = {
        "detection": ev.get("detected", float("nan")),
        "plan_commit": ev.get("committed", float("nan")),
        "power_applied": ev.get("power_applied", float("nan")),
        "reshard": max((a["reshard_s"] for a in applied), default=float("nan")),
        "first_step_after": min((s["t"] for s in steps), default=float("nan")) - since,
    }
    if "acked" in ev:
        phases["all_acked"] = ev["acked"]
    return phases


def _throughput(table: dict[int, dict], lo: float, hi: float) -> float:
    rows = [r for r in table.values() if lo <= r["t"] < hi]
    rows.sort(key=lambda r: r["t"])
    if len(rows) < 2:
        return float("nan")
    return sum(r["global_batch"] for r in rows[1:]) / (rows[-1]["t"] - rows[0]["t"])


def summarize(run: StoryRun, model: DemoModel | None = None) -> Summary:
    """``model``: the story's model (default: the built-in GPT)."""
    model = model or demo_model()
    table = _step_table(run)
    steps = sorted(table)
    batches = [model.batch(s, table[s]["global_batch"]) for s in steps]
    if steps != list(range(len(steps))):
        raise AssertionError(f"the job skipped steps: {sorted(set(range(steps[-1] + 1)) - set(steps))}")
    ref = model.reference(batches)
    rel = max(abs(table[s]["loss"] - r) / max(abs(r), 1e-12) for s, r in zip(steps, ref, strict=True))
    by_gen: dict[int, list[int]] = {}
    for r in table.values():
        by_gen.setdefault(r["generation"], r["degrees"])
    first_after_fail = min((r["t"] for r in table.values() if r["generation"] >= 2), default=run.t_fail)
    first_after_repair = min((r["t"] for r in table.values() if r["generation"] >= 3), default=run.t_repair)
    return Summary(
        phases_failure=phase_timings(run, 2, run.t_fail),
        phases_repair=phase_timings(run, 3, run.t_repair),
        throughput={
            "before": _throughput(table, 0, run.t_fail),
            "during": _throughput(table, first_after_fail, run.t_repair),
            "after": _throughput(table, first_after_repair, float("inf")),
        },
        steps=len(steps),
        parity_max_rel_diff=rel,
        generations=sorted(run.plans),
        degrees_by_generation=dict(sorted(by_gen.items())),
        dp_drop_ratio=run.dp_drop_ratio,
        ntp_pw_ratio=run.ntp_ratio_degraded,
    )


def render(s: Summary, run: StoryRun) -> str:
    lines = ["", "=== tpflex demo summary ===", "",
             "phase (seconds from the event)      GPU failure   GPU repair"]
    for name in ("detection", "plan_commit", "power_applied", "reshard", "first_step_after", "all_acked"):
        a, b = s.phases_failure.get(name), s.phases_repair.get(name)
        if a is None and b is None:
            continue
        fmt = lambda v: f"{v:11.3f}" if v is not None else "          -"  # noqa: E731
        lines.append(f"  {name:<33}{fmt(a)}  {fmt(b)}")
    lines += ["", "throughput (samples/s)     before    during     after"]
    t = s.throughput
    lines.append(f"  measured              {t['before']:9.1f} {t['during']:9.1f} {t['after']:9.1f}")
    lines += ["", "TP degrees per generation: " + ", ".join(
        f"g{g}: {format_degrees(d)}" for g, d in s.degrees_by_generation.items())]
    caps = ", ".join(f"gpu{i}={w:.0f}W" for i, w in sorted(run.caps_degraded.items()))
    lines.append(f"{run.failed_rack} power caps while degraded: {caps}")
    caps = ", ".join(f"gpu{i}={w:.0f}W" for i, w in sorted(run.caps_repaired.items()))
    lines.append(f"{run.failed_rack} power caps after repair:   {caps}")
    lines += ["", f"loss parity vs a single-process reference over {s.steps} steps: "
                  f"max relative difference {s.parity_max_rel_diff:.2e}",
              f"expected throughput while degraded: ntp-pw {s.ntp_pw_ratio:.3f} of failure-free; "
              f"dp-drop would have kept {s.dp_drop_ratio:.3f} (lost {1 - s.dp_drop_ratio:.0%})"]
    v = s.violations()
    lines.append("phase bounds: " + ("all within bounds" if not v else "EXCEEDED: " + "; ".join(v)))
    return "\n".join(lines)
