"""``tpflexctl racks list | apply | propose``: the rack inventory as a YAML file.

``apply -f FILE`` is declarative (as ``kubectl apply``): every rack of the file is checked
by the server first (``PUT /v1/racks/{rack}?dry_run=true``; with ``--prune`` also the
deletion of each stored rack the file does not list), and only when all pass are the
changed ones written. ``--dry-run`` prints what would change (fields old -> new) and, for
each job that uses a changed rack, the planner's changes to its next plan; it writes
nothing. ``propose`` prints an inventory of the registered nodes that no rack lists,
grouped by the rack their agents reported, with the power budget left for the operator.

The file::

    racks:
      - name: rack-a
        domain_size: 8          # = len(nodes) x gpus_per_node
        power_budget_w: 10400
        gpu_tdp_w: 1000
        gpu_min_w: 200
        gpu_max_w: 1300
        gpus_per_node: 4
        nodes: [rack-a-n0, rack-a-n1]
"""

from __future__ import annotations

import argparse
import re
import urllib.parse

import yaml

from tpflex_cli.client import Client, CliError

FIELDS = ("name", "domain_size", "power_budget_w", "gpu_tdp_w", "gpu_min_w", "gpu_max_w", "nodes",
          "gpus_per_node")
PLACEHOLDER = "FILL-ME"


def _q(part: str) -> str:
    return urllib.parse.quote(part, safe="")


# ---- the file ----


def read_inventory(path: str) -> list[dict]:
    """The racks of an inventory file, checked for shape (the server checks the values);
    :class:`CliError` exit 2 naming the file and the problem."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise CliError(f"cannot read the inventory file {path}: {exc.strerror or exc}", 2) from None
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as exc:
        why = str(exc).replace("\n", " ")[:300]
        raise CliError(f"the inventory file {path} is not valid YAML: {why}", 2) from None
    if not isinstance(data, dict) or set(data) != {"racks"} or not isinstance(data["racks"], list):
        raise CliError(f"the inventory file {path} must be a mapping with one key, racks: a list "
                       f"of rack records", 2)
    racks, seen = [], set()
    for i, rack in enumerate(data["racks"]):
        where = f"{path}: racks[{i}]"
        if not isinstance(rack, dict):
            raise CliError(f"{where} is not a mapping of rack fields", 2)
        unknown = sorted(str(k) for k in rack if k not in FIELDS)
        if unknown:
            raise CliError(f"{where}: unknown field {unknown[0]!r} (the fields: {', '.join(FIELDS)})", 2)
        name = rack.get("name")
        if not isinstance(name, str) or not name:
            raise CliError(f"{where}: name (a string) is required", 2)
        where = f"{path}: rack {name}"
        if name in seen:
            raise CliError(f"{where} is listed twice", 2)
        seen.add(name)
        for field, value in rack.items():
            if value == PLACEHOLDER:
                raise CliError(f"{where}: {field} is still the {PLACEHOLDER} placeholder of `tpflexctl "
                               f"racks propose`: fill in the value (watts for the budget)", 2)
        racks.append(dict(rack))
    return racks


# ---- apply ----


def apply(c: Client, a: argparse.Namespace) -> dict:
    wanted = read_inventory(a.file)
    stored, _ = c.pages("/v1/racks")
    names = {r["name"] for r in wanted}
    checked, problems = [], []
    for rack in wanted:  # every rack checked by the server before anything is written
        body = {k: v for k, v in rack.items() if k != "name"}
        try:
            checked.append(("PUT", c.call("PUT", f"/v1/racks/{_q(rack['name'])}", body,
                                          {"dry_run": "true"}), body))
        except CliError as exc:
            if exc.exit_code != 2:
                raise
            problems.append(f"rack {rack['name']}: {exc}")
    if a.prune:
        for rack in sorted(r["name"] for r in stored if r["name"] not in names):
            try:
                checked.append(("DELETE", c.call("DELETE", f"/v1/racks/{_q(rack)}", None,
                                                 {"dry_run": "true"}), None))
            except CliError as exc:
                if exc.exit_code != 2:
                    raise
                problems.append(f"rack {rack} (--prune): {exc}")
    if problems:
        raise CliError("the inventory was refused, nothing was written:\n  " + "\n  ".join(problems), 2)
    results = [r for _, r, _ in checked]
    if not a.dry_run:
        results = []
        for method, result, body in checked:
            if result["action"] == "unchanged":
                results.append(result)
                continue
            path = f"/v1/racks/{_q(result['rack'])}"
            try:
                results.append(c.call(method, path, body))
            except CliError as exc:
                done = [r["rack"] for r in results if r["action"] != "unchanged"]
                raise CliError(f"rack {result['rack']}: {exc} (written before it: "
                               f"{', '.join(done) or 'none'})", exc.exit_code) from None
    unlisted = [] if a.prune else sorted(r["name"] for r in stored if r["name"] not in names)
    return {"dry_run": a.dry_run, "racks": results, "not_in_file": unlisted}


def show_apply(d: dict) -> str:
    out = []
    counts: dict[str, int] = {}
    for r in d["racks"]:
        action = r["action"]
        counts[action] = counts.get(action, 0) + 1
        out.append(f"rack {r['rack']}: {action}" + (" (not in the file: --prune)" if action == "deleted" else ""))
        for ch in r["changes"]:
            out.append(f"  {ch['field']}: {_value(ch['before'])} -> {_value(ch['after'])}")
        for job in r["jobs"]:
            out.append(f"  job {job['job']}: its next plan is recomputed"
                       + (f" ({job['note']})" if job.get("note") else ""))
            out += ["    " + line for line in plan_changes(job.get("changes", []))]
    for name in d.get("not_in_file", []):
        out.append(f"rack {name}: not in the file, kept (--prune deletes it)")
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no racks"
    tail = "dry run: nothing written" if d["dry_run"] else "applied"
    return "\n".join(out + [f"{tail}: {summary}"])


def _value(v) -> str:
    if v is None:
        return "(none)"
    if isinstance(v, list):
        return "[" + ", ".join(map(str, v)) + "]"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def plan_changes(changes: list[dict]) -> list[str]:
    """A dry run's plan changes (``PlanChangeView``) as lines; power caps grouped by
    old -> new."""
    out, caps = [], {}
    for ch in changes:
        if ch["kind"] == "power_cap":
            gpu = ch.get("gpu") or {}
            caps.setdefault((ch["before"], ch["after"]), []).append(f"{gpu.get('node')}:{gpu.get('index')}")
        elif ch["kind"] == "replica":
            out.append(f"replica {ch['replica']} {ch['field']}: {_value(ch['before'])} -> {_value(ch['after'])}")
        else:
            out.append(f"{ch['field']}: {_value(ch['before'])} -> {_value(ch['after'])}")
    for (before, after), gpus in caps.items():
        shown = ", ".join(gpus[:4]) + (f", ... ({len(gpus)} GPUs)" if len(gpus) > 4 else "")
        out.append(f"power cap {_cap(before)} -> {_cap(after)}: {shown}")
    return out


def _cap(w) -> str:
    return "TDP" if w is None else f"{w:.0f} W"


# ---- propose ----


def _natural(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def propose(c: Client, a: argparse.Namespace) -> list[dict]:
    """The registered nodes (every one with ``--all``, else those no rack lists) grouped
    by the rack their agents reported (a node that reported none: a rack of its own)."""
    nodes = c.call("GET", "/v1/inventory/nodes")
    groups: dict[str, list[dict]] = {}
    for n in nodes:
        if a.all or not n["assigned"]:
            groups.setdefault(n["rack"] or n["name"], []).append(n)
    racks = []
    for name in sorted(groups, key=_natural):
        members = sorted(groups[name], key=lambda n: _natural(n["name"]))
        gpus = [g for n in members for g in n["gpus"]]
        per_node = max((len(n["gpus"]) for n in members), default=0)
        racks.append({
            "name": name,
            "nodes": [n["name"] for n in members],
            "gpus_per_node": per_node,
            "domain_size": per_node * len(members),
            # limits every GPU of the rack can take
            "gpu_min_w": max((g["min_limit_w"] for g in gpus), default=0.0),
            "gpu_tdp_w": min((g["default_limit_w"] for g in gpus), default=0.0),
            "gpu_max_w": min((g["max_limit_w"] for g in gpus), default=0.0),
            "sources": sorted({n["rack_source"] or "unknown" for n in members}),
            "uneven": len({len(n["gpus"]) for n in members}) > 1,
        })
    return racks


def show_proposal(racks: list[dict]) -> str:
    out = ["# tpflex rack inventory proposed from the registered nodes (tpflexctl racks propose).",
           f"# Fill in every power_budget_w ({PLACEHOLDER}: `tpflexctl racks apply` refuses it), check",
           "# the node order (= GPU rank order), then: tpflexctl racks apply -f FILE [--dry-run]",
           "racks:" if racks else "racks: []  # every registered node is in a rack record"]
    for r in racks:
        floor, tdp = r["domain_size"] * r["gpu_min_w"], r["domain_size"] * r["gpu_tdp_w"]
        out.append(f'  - name: "{r["name"]}"  # grouped by the rack the agents reported '
                   f'(rack_source: {", ".join(r["sources"])})')
        out.append(f"    domain_size: {r['domain_size']}")
        out.append(f"    power_budget_w: {PLACEHOLDER}  # REQUIRED: watts for all {r['domain_size']} "
                   f"GPUs; at least {floor:g} (domain_size x gpu_min_w); all at TDP: {tdp:g}")
        out.append(f"    gpu_tdp_w: {r['gpu_tdp_w']:g}")
        out.append(f"    gpu_min_w: {r['gpu_min_w']:g}")
        out.append(f"    gpu_max_w: {r['gpu_max_w']:g}")
        note = "  # the nodes report different GPU counts: check" if r["uneven"] else ""
        out.append(f"    gpus_per_node: {r['gpus_per_node']}{note}")
        out.append("    nodes:")
        out += [f'      - "{n}"' for n in r["nodes"]]
    return "\n".join(out)
