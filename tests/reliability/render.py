"""Render the measured figures of the reliability tests (``build/reliability/*.json``,
written by the tests themselves) and, optionally, a ``bench/load.py`` JSON line into the
scenario table of docs/reliability.md, between its BEGIN/END markers.

    .venv/bin/pytest -c tests/pytest.ini tests/reliability -q
    PYTHONPATH=. .venv/bin/python bench/load.py > build/reliability/load.jsonl
    PYTHONPATH=. .venv/bin/python bench/abuse.py > build/reliability/abuse.jsonl
    PYTHONPATH=. .venv/bin/python tests/reliability/render.py [--write docs/reliability.md]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / "build" / "reliability"
BEGIN, END = "<!-- BEGIN measured table -->", "<!-- END measured table -->"
ORDER = [
    "etcd_member_loss", "leader_killed_before_push", "etcd_down_10s", "agent_frozen",
    "controller_restart", "gpu_flapping", "gpu_flapping_no_hold_down", "etcd_compaction_resync", "etcd_malformed_values",
    "rest_schemathesis", "rest_auth", "grpc_agent_fuzz", "grpc_trainer_fuzz",
    "pin_suspended", "agent_power_authority", "rest_bodies", "trainer_specs", "trainer_reports",
    "override_storm", "grpc_fuzz_invariants", "load", "abuse",
]


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _figures(figs: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in figs.items())


def _load_row(path: Path) -> dict | None:
    if not path.exists():
        return None
    line = path.read_text().strip().splitlines()[-1]
    figs = json.loads(line)
    return {
        "scenario": "load", "measured_at": "",
        "injected": f"{figs['nodes']} simulated nodes (own leases, health records) on a real etcd, "
                    f"{figs.get('events_per_minute')} GPU failures+recoveries/min for {figs.get('minutes')} min, "
                    f"{figs.get('rest_clients')} concurrent REST clients",
        "checked": "every committed plan equals tpflex_controller.planner.plan on a state the cluster "
                   "passed through since the job's previous plan; final plans equal the planner's on "
                   "the final state; every plan keeps the invariants of bench/load_oracle.py (no failed "
                   "GPU, degree = usable GPUs, caps within the GPU's limits and the rack budget, "
                   "contiguous generations); every failure of a GPU a plan uses reflected by a plan "
                   "within the deadline (else failures_unreflected, timed as the deadline)",
        "figures": figs,
    }


def _abuse_row(path: Path) -> dict | None:
    if not path.exists():
        return None
    figs = json.loads(path.read_text().strip().splitlines()[-1])
    return {
        "scenario": "abuse", "measured_at": "",
        "injected": f"{figs['requests']} hostile requests (REST, Trainer gRPC, agent gRPC; 8 clients) "
                    "while a synthetic 8-rank job runs and a GPU is failed and repaired over and over",
        "checked": "no 5xx / INTERNAL / UNKNOWN, no transport error (refused, reset, timed out, "
                   "UNAVAILABLE), no REST child restart, no dead process; the invariant oracle every "
                   "2 s and at the end (bench/abuse.py)",
        "figures": figs,
    }


def table() -> str:
    rows = {p.stem: json.loads(p.read_text()) for p in sorted(FIGURES.glob("*.json"))}
    load = _load_row(FIGURES / "load.jsonl")
    if load is not None:
        rows["load"] = load
    abuse = _abuse_row(FIGURES / "abuse.jsonl")
    if abuse is not None:
        rows["abuse"] = abuse
    out = ["| scenario | injected | checked | measured |", "|---|---|---|---|"]
    for name in ORDER + sorted(set(rows) - set(ORDER)):
        row = rows.get(name)
        if row is None:
            out.append(f"| {name} | (not run) | | |")
            continue
        out.append(f"| {name} | {_cell(row['injected'])} | {_cell(row['checked'])} | "
                   f"{_cell(_figures(row['figures']))} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--write", help="replace the table between the markers in this file")
    args = p.parse_args(argv)
    text = table()
    if not args.write:
        print(text)
        return 0
    doc = Path(args.write)
    body = doc.read_text()
    if BEGIN not in body or END not in body:
        print(f"{doc}: markers {BEGIN} / {END} not found", file=sys.stderr)
        return 2
    head, rest = body.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
