"""Outputs at the edge: JSON, CSV and PNG plots of simulation results (I/O lives here)."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from tpflex_controller.sim.config import SimConfigError
from tpflex_controller.sim.engine import SimResult
from tpflex_controller.sim.sweep import SweepRow

TIMELINE_FIELDS = (
    "policy", "time_h", "failed_gpus", "throughput_ratio", "dropped_replicas",
    "degraded_domains", "boosted_gpus", "power_ratio", "spares_needed", "paused",
)


def sim_summary(result: SimResult) -> dict:
    cfg = result.config
    return {
        "config": {
            "cluster": asdict(cfg.cluster),
            "failures": {**asdict(cfg.failures), "blast": cfg.failures.blast.value},
            "days": cfg.days,
            "warmup_days": cfg.warmup_days,
            "placement": cfg.placement.value,
            "seed": cfg.seed,
            "replicas": cfg.cluster.replicas,
        },
        "events": result.events,
        "planner_calls": result.planner_calls,
        "planner_seconds": result.planner_seconds,
        "policies": {p.value: run.summary for p, run in result.runs.items()},
    }


def timeline_rows(result: SimResult) -> Iterable[dict]:
    for policy, run in result.runs.items():
        for s in run.timeline:
            snap = s.snapshot
            yield {
                "policy": policy.value,
                "time_h": round(s.time_h, 4),
                "failed_gpus": s.failed_gpus,
                "throughput_ratio": snap.throughput_ratio,
                "dropped_replicas": snap.dropped_replicas,
                "degraded_domains": snap.degraded_domains,
                "boosted_gpus": snap.boosted_gpus,
                "power_ratio": snap.power_ratio,
                "spares_needed": snap.spares_needed,
                "paused": int(snap.paused),
            }


def write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_csv(path: Path, rows: Iterable[dict], fields: Iterable[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(fields))
        writer.writeheader()
        writer.writerows(rows)


def sweep_fields() -> tuple[str, ...]:
    return tuple(SweepRow.__dataclass_fields__)


def check_plot_path(path: Path, option: str = "--plot") -> None:
    """Refuse a plot path whose extension matplotlib cannot write, before any work (no
    extension: PNG). Does not import pyplot."""
    suffix = path.suffix.lower().lstrip(".")
    if not suffix:
        return
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix not in formats:
        raise SimConfigError(option, f"cannot write a plot as .{suffix}; use one of .{', .'.join(sorted(formats))}")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(result: SimResult, path: Path) -> None:
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for policy, run in result.runs.items():
        xs = [s.time_h / 24 for s in run.timeline] + [result.config.days]
        ys = [s.snapshot.throughput_ratio for s in run.timeline]
        style = "--" if policy.value == "spare" else "-"
        top.step(xs, ys + ys[-1:], style, where="post", label=policy.value)
    first = next(iter(result.runs.values()))
    xs = [s.time_h / 24 for s in first.timeline]
    bottom.step(xs, [100 * s.failed_gpus / result.config.cluster.gpus for s in first.timeline], where="post")
    top.set_ylabel("throughput vs failure-free")
    top.legend()
    bottom.set_ylabel("failed GPUs (%)")
    bottom.set_xlabel("day")
    c = result.config.cluster
    top.set_title(f"{c.gpus} GPUs, TP{c.domain_size} domains, PP{c.pp}, {result.config.placement.value}")
    _save(fig, path)


def plot_sweep(rows: list[SweepRow], path: Path) -> None:
    plt = _pyplot()
    sizes = sorted({r.domain_size for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.2 * len(sizes), 4), squeeze=False)
    for ax, t in zip(axes[0], sizes, strict=True):
        for (policy, placement), pts in _series(rows, t).items():
            style = "-" if placement == "unpacked" else "--"
            xs = [p.failed_fraction * 1e3 for p in pts]
            ax.errorbar(xs, [100 * p.loss_mean for p in pts], yerr=[100 * p.loss_sem for p in pts],
                        fmt=style + "o", ms=3, label=f"{policy} ({placement})")
            if pts[0].closed_form is not None:
                ax.plot(xs, [100 * p.closed_form for p in pts], ":", color="grey")
        ax.set_yscale("symlog", linthresh=1)
        ax.set_title(f"TP{t} domains, PP{rows[0].pp}")
        ax.set_xlabel("failed fraction (x1e-3)")
        ax.set_ylabel("throughput loss (%)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    _save(fig, path)


def _series(rows: list[SweepRow], t: int) -> dict[tuple[str, str], list[SweepRow]]:
    out: dict[tuple[str, str], list[SweepRow]] = {}
    for r in rows:
        if r.domain_size == t:
            out.setdefault((r.policy, r.placement), []).append(r)
    return out


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clear()
