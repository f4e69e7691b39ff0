"""``tpflexctl``: a command-line client of the controller's REST API.

Human tables by default, ``--json`` for the raw response. Exit codes: 0 ok; 2 usage
errors and HTTP 4xx (the server's message is printed); 1 connection failures and 5xx;
130 on Ctrl-C (how ``--watch`` ends). HTTP through httpx (``tpflex_cli.client``), ``--cacert`` for
a private CA, lists read page by page, ``--watch`` follows the console's live stream
(``tpflex_cli.watch``), ``tpflexctl completion bash|zsh`` prints a completion script.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.parse
from collections.abc import Callable, Sequence

from tpflex_cli import jobspec, racks, watch
from tpflex_cli.client import Client, CliError

DEFAULT_URL = "http://127.0.0.1:8470"  # the controller's default rest.listen


# ---- HTTP (tpflex_cli.client) ----


def _read_token(path: str | None) -> str | None:
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            lines = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    except OSError as exc:
        raise CliError(f"cannot read token file {path}: {exc.strerror or exc}", 2) from None
    except UnicodeDecodeError:
        raise CliError(f"token file {path} is not UTF-8 text", 2) from None
    if not lines:
        raise CliError(f"token file {path} is empty", 2)
    if not lines[0].isascii() or not lines[0].isprintable() or " " in lines[0]:
        # an HTTP header carries ASCII only; the controller's tokens are so too
        raise CliError(f"token file {path}: the token is not printable ASCII without spaces", 2)
    return lines[0]


# ---- output ----


def _ts(at: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at)) if at else "-"


def _ratio(x: float | None) -> str:
    return f"{x:.3f}" if x is not None else "-"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], widths: Sequence[int] = ()) -> str:
    cells = [[str(c) for c in r] for r in rows]
    least = list(widths) or [0] * len(headers)
    widths = [max([len(h), least[i]] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def _counts(g: dict) -> list:
    return [g["total"], g["healthy"], g["degraded"], g["failed"], g["drained"]]


_COUNT_HEADERS = ["GPUS", "HEALTHY", "DEGRADED", "FAILED", "DRAINED"]


def show_status(d: dict) -> str:
    leader = d["leader"]
    out = [
        f"leader:   {leader['id'] + ' at ' + leader['address'] if leader else 'none'}",
        f"etcd revision: {d['etcd_revision']}",
        f"racks: {d['racks']}  nodes: {d['nodes']} ({d['live_nodes']} live)",
        "gpus: " + "  ".join(f"{k}={v}" for k, v in d["gpus"].items()),
        *(f"unassigned node {n['node']}: {n['reason']}" for n in d.get("unassigned_nodes", [])),
        "",
    ]
    rows = [
        [j["name"], j["generation"] if j["generation"] is not None else "-", j["policy"],
         _ratio(j["expected_throughput_ratio"]), ",".join(map(str, j["replica_tp_degrees"])) or "-",
         j.get("suspended_pins", 0)]
        for j in d["jobs"]
    ]
    return "\n".join(out) + table(["JOB", "GEN", "POLICY", "THROUGHPUT", "TP DEGREES", "SUSPENDED PINS"], rows)


def show_racks(d: list) -> str:
    rows = [[r["name"], r["domain_size"], len(r["nodes"]), *_counts(r["gpus"]), r["power_budget_w"], r["gpu_tdp_w"]] for r in d]
    return table(["RACK", "DOMAIN", "NODES", *_COUNT_HEADERS, "BUDGET_W", "TDP_W"], rows)


def show_nodes(d: list) -> str:
    rows = [[n["name"], n["rack"], "yes" if n["live"] else "no", n["backend"] or "-", *_counts(n["gpus"]), n["agent_address"] or "-"] for n in d]
    return table(["NODE", "RACK", "LIVE", "BACKEND", *_COUNT_HEADERS, "AGENT"], rows)


def show_gpus(d: list) -> str:
    rows = [[g["node"], g["index"], g["rack"], g["state"], g["reason"] or "-"] for g in d]
    return table(["NODE", "GPU", "RACK", "STATE", "REASON"], rows)


def show_jobs(d: list) -> str:
    rows = []
    for j in d:
        p = j["plan"] or {}
        rows.append([
            j["name"], j["base_tp"], j["replicas"], j["effective_policy"], p.get("generation", "-"),
            ",".join(map(str, p.get("replica_tp_degrees", []))) or "-",
            _ratio(p.get("expected_throughput_ratio")), j["acked_current"],
            len(p.get("suspended_pins", [])),
        ])
    return table(["JOB", "T", "REPLICAS", "POLICY", "GEN", "TP DEGREES", "THROUGHPUT", "ACKED",
                  "SUSPENDED PINS"], rows)


def _replicas(plan: dict) -> str:
    rows = [
        [r["index"], r["state"], r["tp_degree"], r["local_batch"], f"{r['relative_throughput']:.3f}",
         " ".join(f"{st['rack']}:{st['tp_degree']}" for st in r["stages"]) or "-", r["reason"] or "-"]
        for r in plan["replicas"]
    ]
    out = [table(["REPLICA", "STATE", "TP", "BATCH", "THROUGHPUT", "STAGES", "REASON"], rows)]
    by_cap: dict[float, list[str]] = {}
    for c in plan["power_caps"]:
        by_cap.setdefault(c["cap_w"], []).append(f"{c['node']}:{c['index']}")
    for cap, gpus in sorted(by_cap.items()):
        shown = ", ".join(gpus[:4]) + (f", ... ({len(gpus)} GPUs)" if len(gpus) > 4 else "")
        out.append(f"power cap {cap:.0f} W: {shown}")
    out += [f"- {reason}" for reason in plan["reasons"]]
    out += [f"SUSPENDED PIN: replica {p['replica']} -> TP {p['tp_degree']}: {p['reason']}"
            for p in plan.get("suspended_pins", [])]
    return "\n".join(out)


def show_plan(d: dict) -> str:
    head = (
        f"job {d['job']}  generation {d['generation']}  policy {d['policy']}  "
        f"expected throughput {_ratio(d['expected_throughput_ratio'])}  created {_ts(d['created_at'])}"
        + (f"  cause: {d['cause']}" if d["cause"] else "")
        + (f" by {d['by']}" if d.get("by") else "")
    )
    return head + "\n" + _replicas(d)


def show_history(d: dict) -> str:
    rows = [
        [p["generation"], _ts(p["created_at"]), p["policy"], _ratio(p["expected_throughput_ratio"]),
         ",".join(str(r["tp_degree"]) for r in p["replicas"]), p["cause"] or "-"]
        for p in d["plans"]
    ]
    return table(["GEN", "CREATED", "POLICY", "THROUGHPUT", "TP DEGREES", "CAUSE"], rows)


def show_events(d: dict) -> str:
    return show_event_rows(d["events"])


def show_event_rows(events: list, header: bool = True) -> str:
    rows = [[e["seq"], _ts(e["at"]), e["kind"], e["job"] or "-", e["generation"] or "-", e.get("by") or "-",
             e["cause"] or "-"] for e in events]
    out = table(["SEQ", "AT", "KIND", "JOB", "GEN", "BY", "CAUSE"], rows, widths=_EVENT_WIDTHS)
    return out if header else out.split("\n", 1)[1]


_EVENT_WIDTHS = [6, 19, 14, 16, 5, 12, 0]  # fixed under --watch, so that later rows line up


def show_drain(d: dict) -> str:
    what = "drained" if d["drained"] else "undrained"
    note = "" if d["changed"] else " (no change)"
    return f"{what} GPU {d['node']}:{d['index']}{note}" + (f": {d['reason']}" if d["reason"] else "")


def show_reconfigure(d: dict) -> str:
    o = d["override"]
    if o is None:
        return "override cleared; the job follows its spec. " + d["note"]
    pins = ", ".join(f"replica {p['replica']} -> TP {p['tp_degree']}" for p in o["pins"]) or "none"
    return f"job {o['job']}: pins: {pins}; policy: {o['policy'] or '(spec)'}. {d['note']}"


def show_dry_run(d: dict) -> str:
    failed = ", ".join(f"{g['node']}:{g['index']}" for g in d["failed_gpus"]) or "none"
    plan = d["plan"]
    head = (
        f"dry run for job {d['job']} (nothing committed); hypothetical failures: {failed}\n"
        f"policy {plan['policy']}  expected throughput {_ratio(plan['expected_throughput_ratio'])} "
        f"(current plan: {_ratio(d['current_expected_throughput_ratio'])})"
    )
    return head + "\n" + _replicas(plan)


# ---- commands ----


def _digits(text: str) -> bool:
    """ASCII digits only, as the API takes them (``str.isdigit`` also takes '٣' and '²',
    and ``int`` takes ' +1')."""
    return text.isascii() and text.isdigit()


def _pin(text: str) -> dict:
    replica, sep, degree = text.partition("=")
    if not sep or not _digits(replica) or not _digits(degree):
        raise argparse.ArgumentTypeError(f"expected REPLICA=TP (e.g. 1=7), got {text!r}")
    return {"replica": int(replica), "tp_degree": int(degree)}


def _gpu(text: str) -> dict:
    node, sep, index = text.rpartition(":")
    if not sep or not node or not _digits(index):
        raise argparse.ArgumentTypeError(f"expected NODE:GPU (e.g. node-3:5), got {text!r}")
    return {"node": node, "index": int(index)}


def _index(text: str) -> int:
    if not _digits(text):
        raise argparse.ArgumentTypeError(f"expected a GPU index (0, 1, ...), got {text!r}")
    return int(text)


def _q(part: str) -> str:
    return urllib.parse.quote(part, safe="")


Command = Callable[[Client, argparse.Namespace], tuple[object, Callable[[object], str]]]


def _run_plan(c: Client, a: argparse.Namespace):
    if a.watch:
        return _watch(lambda: watch.watch_plan(c, a.job, _render(a, show_plan), _out, watch.print_err))
    if a.history:
        return c.call("GET", f"/v1/jobs/{_q(a.job)}/plans", query={"limit": a.limit}), show_history
    return c.call("GET", f"/v1/jobs/{_q(a.job)}/plan"), show_plan


def _gpu_path(a: argparse.Namespace, action: str) -> str:
    return f"/v1/nodes/{_q(a.node)}/gpus/{a.gpu}/{action}"


def _run_reconfigure(c: Client, a: argparse.Namespace):
    body = {"pins": a.pin, "policy": a.policy, "reason": a.reason, "clear": a.clear}
    return c.call("POST", f"/v1/jobs/{_q(a.job)}/reconfigure", body), show_reconfigure


def _run_dry_run(c: Client, a: argparse.Namespace):
    body = {"fail": a.fail, "policy": a.policy, "ignore_overrides": a.ignore_overrides}
    return c.call("POST", f"/v1/jobs/{_q(a.job)}/dry-run", body), show_dry_run


def _run_set_spec(c: Client, a: argparse.Namespace):
    def finite(text: str) -> float:
        raise ValueError(f"{text} is not a number JSON allows")

    try:
        with open(a.file, encoding="utf-8") as f:
            body = json.load(f, parse_constant=finite)
    except (OSError, ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        why = "nested too deeply" if isinstance(exc, RecursionError) else exc
        raise CliError(f"cannot read the spec file {a.file}: {why}", 2) from None
    return c.call("PUT", f"/v1/jobs/{_q(a.job)}/spec", body), lambda d: (
        f"job {d['job']}: spec {'changed' if d['changed'] else 'unchanged'}. {d['note']}")


def _out(text: str) -> None:
    print(text, flush=True)


def _render(a: argparse.Namespace, show: Callable[[object], str]) -> Callable[[object], str]:
    return (lambda d: json.dumps(d)) if a.json else show


def _watch(follow: Callable[[], None]):
    """Run a --watch loop; its output is already printed (nothing left to render)."""
    follow()
    return None, None


def _list(path: str, show, query: Callable[[argparse.Namespace], dict] = lambda a: {}) -> Command:
    """A paginated list: every page (or --limit items after --after); the next cursor on stderr."""
    def run(c: Client, a: argparse.Namespace):
        items, cursor = c.pages(path, query(a), a.limit, a.after)
        if cursor is not None and a.limit is not None:
            print(f"tpflexctl: more items follow; next page: --after {cursor}", file=sys.stderr)
        return items, show
    return run


def _run_events(c: Client, a: argparse.Namespace):
    if a.watch:
        rows = (lambda evs, header=True: "\n".join(json.dumps(e) for e in evs)) if a.json else show_event_rows
        return _watch(lambda: watch.watch_events(c, a, rows, _out, watch.print_err))
    return c.call("GET", "/v1/events", query={"limit": a.limit, "job": a.job}), show_events


def _run_racks(c: Client, a: argparse.Namespace):
    """``racks`` alone or ``racks list``: the table; ``apply`` and ``propose`` (tpflex_cli.racks)."""
    if a.racks_command == "apply":
        return racks.apply(c, a), racks.show_apply
    if a.racks_command == "propose":
        return racks.propose(c, a), racks.show_proposal
    return _list("/v1/racks", show_racks)(c, a)


def _run_issue_credential(c: Client, a: argparse.Namespace):
    """Issue a job credential and write its secret to ``--out`` (created 0600, never over
    an existing file; ``-``: standard output): the answer printed leaves the secret out."""
    out = None
    if a.out != "-":
        try:  # before the call: a credential issued into a file that cannot be written is lost
            out = os.open(a.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise CliError(f"--out: cannot create {a.out}: {exc.strerror}", 2) from None
    try:
        d = c.call("POST", f"/v1/jobs/{_q(a.job)}/credentials", {"name": a.name})
    except BaseException:
        if out is not None:
            os.close(out)
            os.unlink(a.out)
        raise
    secret = d.pop("credential", "")
    if out is None:
        print(secret)
    else:
        with os.fdopen(out, "w") as f:
            f.write(secret + "\n")
    where = "printed above" if out is None else f"written to {a.out}"
    return d, lambda d: (f"job {d['job']}: credential {d['name']} issued ({where}; pass it to "
                         f"tpflex-run --job-credential-file)")


def show_credentials(items: list[dict]) -> str:
    rows = [(c["name"], c["issued_by"], time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(c["issued_at"])))
            for c in items]
    return table(["NAME", "ISSUED BY", "ISSUED AT (UTC)"], rows)


COMMANDS: dict[str, Command] = {
    "status": lambda c, a: (c.call("GET", "/v1/status"), show_status),
    "racks": _run_racks,
    "nodes": _list("/v1/nodes", show_nodes),
    "gpus": _list("/v1/gpus", show_gpus, lambda a: {"state": a.state, "rack": a.rack}),
    "jobs": _list("/v1/jobs", show_jobs),
    "plan": _run_plan,
    "events": _run_events,
    "drain": lambda c, a: (c.call("POST", _gpu_path(a, "drain"), {"reason": a.reason}), show_drain),
    "undrain": lambda c, a: (c.call("POST", _gpu_path(a, "undrain")), show_drain),
    "reconfigure": _run_reconfigure,
    "dry-run": _run_dry_run,
    "set-spec": _run_set_spec,
    "delete-job": lambda c, a: (c.call("DELETE", f"/v1/jobs/{_q(a.job)}"),
                                lambda d: f"job {d['job']} deleted. {d['note']}"),
    "credentials": lambda c, a: (c.call("GET", f"/v1/jobs/{_q(a.job)}/credentials"), show_credentials),
    "issue-credential": _run_issue_credential,
    "revoke-credential": lambda c, a: (
        c.call("DELETE", f"/v1/jobs/{_q(a.job)}/credentials/{_q(a.name)}"),
        lambda d: f"job {d['job']}: credential {d['name']} revoked ({d['note']})"),
}

_POLICIES = ["ntp-pw", "ntp", "dp-drop", "spare"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpflexctl", description="Inspect and steer the tpflex controller.")
    p.add_argument("--url", default=os.environ.get("TPFLEX_URL", DEFAULT_URL),
                   help=f"controller REST URL (env TPFLEX_URL; default {DEFAULT_URL})")
    p.add_argument("--token-file", default=os.environ.get("TPFLEX_TOKEN_FILE"),
                   help="file holding the bearer token (env TPFLEX_TOKEN_FILE)")
    p.add_argument("--cacert", default=os.environ.get("TPFLEX_CACERT"),
                   help="CA certificate (PEM) that signed the controller's HTTPS certificate "
                        "(env TPFLEX_CACERT; default: the system's CAs)")
    p.add_argument("--json", action="store_true", help="print the raw JSON response")
    p.add_argument("--timeout", type=_positive, default=10.0, help="request timeout in seconds")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("status", help="leader, GPU counts, jobs")
    rk = _paged(sub.add_parser("racks", help="list racks; racks apply|propose: the rack inventory"))
    rsub = rk.add_subparsers(dest="racks_command", metavar="{list,apply,propose}")
    rl = rsub.add_parser("list", help="list racks (as `racks` alone)")
    rl.add_argument("--limit", type=_count, default=argparse.SUPPRESS, help="at most this many racks")
    rl.add_argument("--after", default=argparse.SUPPRESS, help="start after this cursor")
    ra = rsub.add_parser("apply", help="write the racks of an inventory YAML file (admin)")
    ra.add_argument("-f", "--file", required=True, help="inventory YAML: racks: [rack records]")
    ra.add_argument("--dry-run", action="store_true",
                    help="print what would change and the plan changes it causes; write nothing")
    ra.add_argument("--prune", action="store_true", help="also delete the racks the file does not list")
    rp = rsub.add_parser("propose", help="print an inventory YAML of the nodes no rack lists")
    rp.add_argument("--all", action="store_true", help="every registered node, listed in a rack or not")
    _paged(sub.add_parser("nodes", help="list nodes"))
    g = _paged(sub.add_parser("gpus", help="list GPUs with health"))
    g.add_argument("--state", choices=["healthy", "degraded", "failed", "drained"])
    g.add_argument("--rack")
    _paged(sub.add_parser("jobs", help="list jobs with their current plan"))
    pl = sub.add_parser("plan", help="a job's current plan (or its history)")
    pl.add_argument("job")
    how = pl.add_mutually_exclusive_group()
    how.add_argument("--history", action="store_true")
    how.add_argument("--watch", action="store_true", help="print each new generation as it is committed")
    pl.add_argument("--limit", type=_count, default=100)
    ev = sub.add_parser("events", help="latest controller decisions")
    ev.add_argument("--limit", type=_count, default=50)
    ev.add_argument("--job")
    ev.add_argument("--watch", action="store_true", help="then print each new decision as it happens")
    c = sub.add_parser("completion", help="print a shell completion script")
    c.add_argument("shell", choices=["bash", "zsh"])
    d = sub.add_parser("drain", help="take a GPU out of every plan")
    d.add_argument("node")
    d.add_argument("gpu", type=_index)
    d.add_argument("--reason", required=True)
    u = sub.add_parser("undrain", help="give a drained GPU back")
    u.add_argument("node")
    u.add_argument("gpu", type=_index)
    r = sub.add_parser("reconfigure", help="pin replicas' TP degrees and/or switch policy")
    r.add_argument("job")
    r.add_argument("--pin", type=_pin, action="append", default=[], metavar="REPLICA=TP")
    r.add_argument("--policy", choices=_POLICIES)
    r.add_argument("--reason", default="")
    r.add_argument("--clear", action="store_true", help="drop earlier pins and policy first")
    dr = sub.add_parser("dry-run", help="plan as if GPUs failed; commits nothing")
    dr.add_argument("job")
    dr.add_argument("--fail", type=_gpu, action="append", default=[], metavar="NODE:GPU")
    dr.add_argument("--policy", choices=_POLICIES)
    dr.add_argument("--ignore-overrides", action="store_true")
    ss = sub.add_parser("set-spec", help="change a registered job's spec (admin)")
    ss.add_argument("job")
    ss.add_argument("--file", required=True, help="the spec as JSON (see docs/api.md)")
    dj = sub.add_parser("delete-job", help="delete a job: spec, override, acks; its plan goes (admin)")
    dj.add_argument("job")
    cr = sub.add_parser("credentials", help="a job's trainer credentials: names, issuer, time (admin)")
    cr.add_argument("job")
    ic = sub.add_parser("issue-credential", help="issue a trainer credential of a job (admin)")
    ic.add_argument("job")
    ic.add_argument("name", help="e.g. node-<node>; an existing name gets a new secret")
    ic.add_argument("--out", required=True, help="file for the secret (created 0600); - prints it")
    rc = sub.add_parser("revoke-credential", help="revoke a trainer credential of a job (admin)")
    rc.add_argument("job")
    rc.add_argument("name")
    jobspec.add_parser(sub)  # no controller contacted
    return p


def _count(text: str) -> int:
    if not _digits(text) or not 1 <= int(text) <= 10_000:
        raise argparse.ArgumentTypeError(f"expected a count from 1 to 10000, got {text!r}")
    return int(text)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"expected seconds in (0, 3600], got {text!r}")
    return value


def _paged(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--limit", type=_count, help="at most this many items (default: all, read page by page)")
    p.add_argument("--after", help="start after this cursor (printed when more items follow)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse printed the usage error (or --help)
        return exc.code if isinstance(exc.code, int) else 2
    if args.command == "completion":
        print(watch.completion(parser, args.shell))
        return 0
    if args.command == jobspec.COMMAND:
        return jobspec.run(args)
    client = None
    try:
        client = Client(args.url, _read_token(args.token_file), args.timeout, args.cacert)
        data, render = COMMANDS[args.command](client, args)
    except CliError as exc:
        print(f"tpflexctl: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    finally:
        if client is not None:
            client.close()
    if render is None:
        return 0
    try:
        print(json.dumps(data, indent=2) if args.json else render(data))
    except (KeyError, TypeError, AttributeError) as exc:
        print(f"tpflexctl: error: unexpected response shape ({exc!r}); try --json", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
