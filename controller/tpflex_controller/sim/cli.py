"""`tpflex-sim`: goodput simulator on the production planner.

    tpflex-sim run --preset paper-nvl32 [--policy ntp-pw,ntp] [--days 15] [--json out.json]
    tpflex-sim sweep --preset paper [--csv loss.csv] [--plot loss.png]
    tpflex-sim paper --out-dir docs/img
    tpflex-sim presets

Bad input exits 2 with a message naming the parameter.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from tpflex_controller.planner import Policy
from tpflex_controller.sim import paper
from tpflex_controller.sim.config import (
    MAX_DAYS,
    MAX_DOMAIN_SIZE,
    MAX_DRAWS,
    MAX_GPUS,
    MAX_RATE,
    MAX_RATE_SCALE,
    MAX_SAMPLES,
    MIN_FRACTION,
    PRESETS,
    SWEEP_PRESETS,
    Blast,
    Placement,
    SimConfigError,
    with_changes,
)
from tpflex_controller.sim.engine import simulate
from tpflex_controller.sim.progress import ProgressBar
from tpflex_controller.sim.report import (
    TIMELINE_FIELDS,
    check_plot_path,
    plot_sweep,
    plot_timeline,
    sim_summary,
    sweep_fields,
    timeline_rows,
    write_csv,
    write_json,
)
from tpflex_controller.sim.sweep import run_sweep

POLICY_NAMES = [p.value for p in Policy]


def _list_of(kind, name: str):
    def parse(text: str):
        try:
            return tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not a comma-separated list of {name}: {text!r} ({exc})") from None

    return parse


def _policy(text: str) -> Policy:
    try:
        return Policy.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _policies(text: str) -> tuple[Policy, ...]:
    if text == "all":
        return tuple(Policy)
    return tuple(_policy(x) for x in text.split(",") if x)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", type=_policies, help=f"comma list of {', '.join(POLICY_NAMES)} or 'all'")
    p.add_argument("--seed", type=int)
    p.add_argument("--rack-headroom", type=float, help="rack budget above T x TDP (fraction)")
    p.add_argument("--device-max-w", type=_list_of(float, "watts"),
                   help="W[,W...] max power limit the GPUs report, per domain (cycled over the domains; "
                        "default limit = TDP); a domain at TDP has no headroom: ntp-pw runs it as plain NTP")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--json", type=Path, help="write results as JSON here")
    p.add_argument("--csv", type=Path, help="write results as CSV here")
    p.add_argument("--plot", type=Path, help="write a plot here (PNG; .svg, .pdf etc. by extension)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpflex-sim", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="simulate failures over time (discrete events)")
    run.add_argument("--preset", choices=sorted(PRESETS), default="paper-nvl32")
    run.add_argument("--gpus", type=int, help=f"at most {MAX_GPUS:,}")
    run.add_argument("--domain-size", type=int,
                     help=f"GPUs per NVLink domain = base TP degree (at most {MAX_DOMAIN_SIZE})")
    run.add_argument("--pp", type=int, help="pipeline stages (domains) per replica")
    run.add_argument("--gpus-per-node", type=int)
    run.add_argument("--spares", type=int, help="spare domains")
    run.add_argument("--min-tp", type=int)
    run.add_argument("--days", type=float, help=f"at most {MAX_DAYS:g}")
    run.add_argument("--warmup-days", type=float, help=f"at most {MAX_DAYS:g}")
    run.add_argument("--rate", type=float,
                     help=f"failures per GPU-hour (default: Llama 3's; at most {MAX_RATE:g}; "
                          f"rate x scale x GPUs x hours at most {MAX_DRAWS:,})")
    run.add_argument("--rate-scale", type=float,
                     help=f"multiply the rate (failure rates swing up to 7x; at most {MAX_RATE_SCALE:g})")
    run.add_argument("--hw-fraction", type=float)
    run.add_argument("--hw-repair-days", type=_list_of(float, "days"), help="MIN[,MAX] uniform, finite")
    run.add_argument("--sw-repair-hours", type=float)
    run.add_argument("--blast", choices=[b.value for b in Blast])
    run.add_argument("--placement", choices=[p.value for p in Placement])
    _common(run)
    sw = sub.add_parser("sweep", help="loss vs failed fraction (static snapshots)")
    sw.add_argument("--preset", choices=sorted(SWEEP_PRESETS), default="paper")
    sw.add_argument("--gpus", type=int, help=f"at most {MAX_GPUS:,}")
    sw.add_argument("--pp", type=int)
    sw.add_argument("--domain-sizes", type=_list_of(int, "integers"),
                    help=f"comma list, each at most {MAX_DOMAIN_SIZE}")
    sw.add_argument("--fractions", type=_list_of(float, "numbers"),
                    help=f"comma list of failed fractions, each 0 or in [{MIN_FRACTION:g}, 1)")
    sw.add_argument("--samples", type=int, help=f"at most {MAX_SAMPLES:,}")
    sw.add_argument("--spare-fraction", type=float, help="spare domains per job domain")
    sw.add_argument("--placement", choices=["unpacked", "packed", "both"])
    _common(sw)
    pp = sub.add_parser("paper", help="reproduce the paper's table and plots")
    pp.add_argument("--out-dir", type=Path, default=Path("docs/img"))
    pp.add_argument("--samples", type=int, default=8)
    pp.add_argument("--no-progress", action="store_true")
    sub.add_parser("presets", help="list the presets")
    return parser


def run_config(args: argparse.Namespace):
    base = PRESETS[args.preset]
    hw_days = args.hw_repair_days
    if hw_days is not None and len(hw_days) == 1:
        hw_days = (hw_days[0], hw_days[0])
    if hw_days is not None and len(hw_days) != 2:
        raise SimConfigError("--hw-repair-days", "give MIN or MIN,MAX")
    cluster = with_changes(
        base.cluster, gpus=args.gpus, domain_size=args.domain_size, pp=args.pp,
        gpus_per_node=args.gpus_per_node, spares=args.spares, min_tp=args.min_tp,
        rack_headroom=args.rack_headroom, device_max_w=args.device_max_w,
    )
    failures = with_changes(
        base.failures, rate_per_gpu_hour=args.rate, rate_scale=args.rate_scale,
        hw_fraction=args.hw_fraction, hw_repair_days=hw_days, sw_repair_hours=args.sw_repair_hours,
        blast=Blast(args.blast) if args.blast else None,
    )
    return with_changes(
        replace(base, cluster=cluster, failures=failures), days=args.days,
        warmup_days=args.warmup_days, policies=args.policy, seed=args.seed,
        placement=Placement(args.placement) if args.placement else None,
    ).validate()


def sweep_config(args: argparse.Namespace):
    placements = None
    if args.placement:
        placements = tuple(Placement) if args.placement == "both" else (Placement(args.placement),)
    return with_changes(
        SWEEP_PRESETS[args.preset], gpus=args.gpus, pp=args.pp, domain_sizes=args.domain_sizes,
        fractions=args.fractions, samples=args.samples, spare_fraction=args.spare_fraction,
        policies=args.policy,
        placements=placements, rack_headroom=args.rack_headroom, seed=args.seed,
        device_max_w=args.device_max_w,
    ).validate()


def cmd_run(args: argparse.Namespace) -> int:
    cfg = run_config(args)
    if args.plot:
        check_plot_path(args.plot)
    bar = None if args.no_progress else ProgressBar("simulating")
    result = simulate(cfg, bar)
    summary = sim_summary(result)
    print(paper.format_run_table(summary))
    if args.json:
        write_json(args.json, summary)
    if args.csv:
        write_csv(args.csv, timeline_rows(result), TIMELINE_FIELDS)
    if args.plot:
        plot_timeline(result, args.plot)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    cfg = sweep_config(args)
    if args.plot:
        check_plot_path(args.plot)
    bar = None if args.no_progress else ProgressBar("sweeping")
    rows = run_sweep(cfg, bar)
    print(paper.format_sweep_table(rows))
    if args.json:
        write_json(args.json, [r.as_dict() for r in rows])
    if args.csv:
        write_csv(args.csv, (r.as_dict() for r in rows), sweep_fields())
    if args.plot:
        plot_sweep(rows, args.plot)
    return 0


def cmd_presets(_: argparse.Namespace) -> int:
    for name, cfg in sorted(PRESETS.items()):
        c = cfg.cluster
        print(f"run   {name:12s} {c.gpus} GPUs, TP{c.domain_size} domains, PP{c.pp}, {cfg.days:g} days")
    for name, sw in sorted(SWEEP_PRESETS.items()):
        print(f"sweep {name:12s} ~{sw.gpus} GPUs, domains {list(sw.domain_sizes)}, PP{sw.pp}, {sw.samples} samples")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    commands = {"run": cmd_run, "sweep": cmd_sweep, "presets": cmd_presets, "paper": paper.cmd_paper}
    try:
        return commands[args.command](args)
    except SimConfigError as exc:
        parser.error(str(exc))  # exits 2 with the message
    except OSError as exc:
        print(f"tpflex-sim: cannot write output: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
