"""Abuse: hostile requests over REST, the Trainer gRPC service and the agents' gRPC, while
a job runs, against real processes (etcd, a ``tpflex-controller``, four ``tpflex-agent``
processes with simulated GPUs: 2 racks x 2 nodes x 2 GPUs, one job at TP 4 + 4).

The running job is a synthetic trainer, not the demo's torch workers: eight
``ControlClient`` ranks (the client the trainer hooks use) stream plans and ack every
generation, and a reporter sends each replica's honest step reports every 0.1 s. A
decision prober fails and repairs a GPU through its agent (XID 79 / recover) over and
over and times each one until the committed plan reflects it (injection -> plan in
etcd), the decision latency under abuse.

Hostile requests (at least ``--requests``, default 10,000, from ``--clients`` threads):
REST without / with a wrong / read-only token (bodies read only after the token), bodies
over the size limit, nested JSON, invalid UTF-8, unknown fields, control characters,
``%2f`` and non-canonical indices in paths, admin drain/undrain churn of one GPU; Trainer
reports that cannot be true (2^32-1 samples in 1e-9 s, NaN, replica 99), stale and future
acks, conflicting and changed specs, unknown jobs; agent pushes with forged generations
(2^64-1), invalid caps, resets, unknown fault kinds.

Prints one JSON line: ``requests``, ``server_errors`` (HTTP 5xx other than a deliberate
503 busy, gRPC INTERNAL/UNKNOWN/DATA_LOSS, a transport error: a connection refused or
reset, a timeout, gRPC UNAVAILABLE/DEADLINE_EXCEEDED, a reply without details; a dead
process; each restart of the controller's REST child: ``classify_grpc``,
``classify_rest``, ``classify_transport``, ``rest_child_errors``), ``transport_errors``
and ``rest_child_restarts`` (those two parts of it), ``invariant_violations`` (the oracle of
tests/reliability/invariants.py, sampled every 2 s during the run and at the end; a
violation counts when it outlasts one reconcile), ``rss_peak_mb`` (the controller's
VmHWM), ``rest_rss_peak_mb`` (its REST child's, where the REST requests land),
``decision_p99_ms_during_abuse``. Details and the decision p99 of a quiet baseline
run first in the same process go to stderr.

``TPFLEX_BENCH_PLANT=kill-rest-child`` plants a defect to see the accounting catch it: the
bench SIGKILLs the controller's REST child once half the hostile requests are sent (the
controller restarts it; the requests in flight fail on their connections).

``--quick``: 200 hostile requests from 4 clients after 2 baseline decisions (the same keys,
seconds; for the test suite, its figures are not the measurement's).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
from tpflex_proto import (
    agent_pb2,
    agent_pb2_grpc,
    controller_pb2,
    controller_pb2_grpc,
    types_pb2,
)

from bench import plants
from tests.reliability import invariants
from tests.reliability.fleet import ADMIN_TOKEN, Fleet
from tests.support import procfs
from tests.support.etcd_server import EtcdCluster

PROBE_GPU = ("rack0-n00", 0)
CHURN_GPU = ("rack1-n01", 1)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, round(q * (len(xs) - 1)))], 2) if xs else -1.0


PLANTS = ("kill-rest-child",)


def planted(env: dict | None = None) -> str | None:
    """The defect ``TPFLEX_BENCH_PLANT`` asks this bench to plant (``bench.plants``)."""
    return plants.planted("abuse.py", PLANTS, env)


class Tally:
    def __init__(self, half: int = 0) -> None:
        self.lock = threading.Lock()
        self.requests = 0
        self.outcomes: Counter[str] = Counter()
        self.server_errors: list[str] = []
        self.halfway = threading.Event()  # set once ``half`` requests are counted
        self._half = half

    def add(self, kind: str, outcome: str, server_error: bool, transport: bool = False) -> None:
        """One request's outcome; ``transport``: it failed on its connection or deadline
        (always a server error: the server did not answer)."""
        server_error = server_error or transport
        with self.lock:
            self.requests += 1
            self.outcomes[f"{kind}:{outcome}"] += 1
            if server_error and len(self.server_errors) < 20:
                self.server_errors.append(f"{kind}:{outcome}")
            if server_error:
                self.outcomes["SERVER_ERROR"] += 1
            if transport:
                self.outcomes["TRANSPORT_ERROR"] += 1
            if self._half and self.requests >= self._half:
                self.halfway.set()


# gRPC codes that say the server failed, or that no serving process answered: a refusal of
# hostile input is INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND, ALREADY_EXISTS,
# RESOURCE_EXHAUSTED, ... with details
_GRPC_SERVER_ERRORS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS}
_GRPC_TRANSPORT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def classify_grpc(code: grpc.StatusCode, details: str | None) -> tuple[bool, bool]:
    """(server error, transport error) of a failed gRPC call: UNAVAILABLE (connection
    refused or reset, the server gone; also the server's own "etcd unavailable", which a
    healthy local etcd never is) and DEADLINE_EXCEEDED are transport errors, hence server
    errors; INTERNAL/UNKNOWN/DATA_LOSS and a status without details are server errors."""
    transport = code in _GRPC_TRANSPORT
    return transport or code in _GRPC_SERVER_ERRORS or not details, transport


def classify_rest(status: int, body: str) -> bool:
    """Whether an HTTP reply is a server error: a 5xx other than the deliberate 503 busy."""
    return status >= 500 and not (status == 503 and "busy" in body)


def classify_transport(exc: httpx.HTTPError) -> tuple[str, bool]:
    """(outcome, transport error) of a REST request that raised, always a server error (no
    reply to read): an ``httpx`` transport failure (connection refused or reset, a
    timeout, a protocol error, a body write that failed) is a transport error; another
    (a reply that cannot be decoded) is not."""
    return type(exc).__name__, isinstance(exc, httpx.TransportError)


def rest_child_errors(before: list[int], after: list[int], alive) -> tuple[int, int]:
    """(server errors, restarts) the controller's REST child adds: one per child started
    after ``before`` (the pids the controller logged when the abuse began; ``after``: at
    its end), and one more when no child is running at the end (``alive(pid)``)."""
    if not before:
        raise ValueError("no REST child at the start: nothing to compare with")
    restarts = len([p for p in after if p not in before])
    gone = not after or not alive(after[-1])
    return restarts + int(gone), restarts


# ---- hostile requests ----


def _rest_requests(url: str) -> list:
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    json_h = {"Content-Type": "application/json"}
    reconf = f"{url}/v1/jobs/job1/reconfigure"
    big = b'{"reason": "' + b"x" * (2 << 20) + b'"}'
    return [
        ("rest_no_token", lambda c: c.post(reconf, json={"pins": []})),
        ("rest_wrong_token", lambda c: c.post(reconf, json={"clear": True}, headers={"Authorization": "Bearer nope"})),
        ("rest_unauth_big", lambda c: c.post(reconf, content=big, headers=json_h)),
        ("rest_admin_big", lambda c: c.post(reconf, content=big, headers={**admin, **json_h})),
        ("rest_nested", lambda c: c.post(reconf, content="[" * 5000 + "]" * 5000, headers={**admin, **json_h})),
        ("rest_utf8", lambda c: c.post(reconf, content=b'{"reason":"\xff"}', headers={**admin, **json_h})),
        ("rest_extra", lambda c: c.post(reconf, json={"pins": [], "evil": 1}, headers=admin)),
        ("rest_ctrl", lambda c: c.post(f"{url}/v1/nodes/rack0-n00/gpus/1/drain", json={"reason": "a\x1b[31m"},
                                       headers=admin)),
        ("rest_slash", lambda c: c.get(f"{url}/v1/nodes/%2f")),
        ("rest_index", lambda c: c.get(f"{url}/v1/nodes/rack0-n00/gpus/{random.choice(['1.0', '+1', '01', '1e0'])}")),
        ("rest_pin", lambda c: c.post(reconf, json={"pins": [{"replica": 7, "tp_degree": 99}]}, headers=admin)),
        ("rest_spec", lambda c: c.put(f"{url}/v1/jobs/job1/spec", json={"base_tp": 4}, headers=admin)),
        ("rest_read", lambda c: c.get(f"{url}/v1/{random.choice(['status', 'jobs', 'gpus', 'events'])}")),
        ("rest_drain", lambda c: c.post(f"{url}/v1/nodes/{CHURN_GPU[0]}/gpus/{CHURN_GPU[1]}/"
                                        f"{random.choice(['drain', 'undrain'])}", json={"reason": "churn"},
                                        headers=admin)),
    ]


def _report(**kw) -> controller_pb2.StepReport:
    base = dict(job="job1", rank=0, replica=0, step=1, generation=1, step_seconds=0.1, samples=8,
                tp_degree=4, base_tp=4)
    return controller_pb2.StepReport(**{**base, **kw})


def _trainer_requests() -> list:
    def spec(name, racks, gb=None):
        from tpflex_controller import synthetic

        s = synthetic.job(name, racks, 4)
        if gb is not None:
            s.global_batch = gb
        return controller_pb2.RegisterJobRequest(spec=s)

    return [
        ("t_report_huge", "ReportStep", lambda: _report(samples=2**32 - 1, step_seconds=1e-9, step=random.randrange(1 << 30))),
        ("t_report_nan", "ReportStep", lambda: _report(step_seconds=random.choice([math.nan, math.inf, -1.0]))),
        ("t_report_replica", "ReportStep", lambda: _report(replica=99)),
        ("t_report_future", "ReportStep", lambda: _report(generation=2**40)),
        ("t_ack_stale", "AckPlan", lambda: types_pb2.Ack(job="job1", rank=random.randrange(8), generation=1)),
        ("t_ack_future", "AckPlan", lambda: types_pb2.Ack(job="job1", rank=0, generation=2**63)),
        ("t_ack_nan", "AckPlan", lambda: types_pb2.Ack(job="job1", rank=0, generation=1, reshard_seconds=math.nan)),
        ("t_register_conflict", "RegisterJob", lambda: spec("intruder", ["rack0"])),
        ("t_register_changed", "RegisterJob", lambda: spec("job1", ["rack0"])),
        ("t_register_zero", "RegisterJob", lambda: spec("zero", ["rack0"], gb=0)),
        ("t_unknown_job", "ReportStep", lambda: _report(job=f"ghost{random.randrange(1000)}")),
    ]


def _agent_requests(nodes: list[str]) -> list:
    def plan(node, gen, watts):
        req = agent_pb2.ApplyPowerPlanRequest(generation=gen)
        for i in (0, 1):
            req.caps.add(gpu=types_pb2.GpuRef(node=node, index=i), cap_w=watts)
        return req

    return [
        ("a_forged", "ApplyPowerPlan", lambda n: plan(n, 2**64 - 1, 200.0)),
        ("a_forged_low", "ApplyPowerPlan", lambda n: plan(n, random.randint(1, 50), 910.0)),
        ("a_invalid", "ApplyPowerPlan", lambda n: plan(n, 5, random.choice([math.nan, 5000.0, -1.0]))),
        ("a_reset", "ResetToDefaults", lambda n: agent_pb2.ResetToDefaultsRequest(generation=random.randint(0, 2**63))),
        ("a_fault", "InjectFault", lambda n: agent_pb2.InjectFaultRequest(index=random.choice([0, 9, 2**31]),
                                                                            kind=random.choice(["bogus", ""]))),
        ("a_devices", "GetDevices", lambda n: agent_pb2.GetDevicesRequest()),
    ]


def _grpc_call(tally: Tally, kind: str, fn, request) -> None:
    try:
        fn(request, timeout=10)
        tally.add(kind, "ok", False)
    except grpc.RpcError as exc:
        code = exc.code()
        server, transport = classify_grpc(code, exc.details())
        tally.add(kind, code.name, server, transport)


def _rest_call(tally: Tally, kind: str, fn, client: httpx.Client) -> None:
    try:
        r = fn(client)
    except httpx.HTTPError as exc:
        outcome, transport = classify_transport(exc)
        tally.add(kind, outcome, True, transport)
        return
    tally.add(kind, str(r.status_code), classify_rest(r.status_code, r.text))


def abuse(fleet: Fleet, ctl, total: int, clients: int, tally: Tally) -> None:
    rest = _rest_requests(ctl.rest_url)
    trainer = _trainer_requests()
    agent = _agent_requests(list(fleet.agents))
    tchan = grpc.insecure_channel(Fleet.trainer_endpoint(ctl))
    tstub = controller_pb2_grpc.TrainerStub(tchan)
    achans = {n: grpc.insecure_channel(a.grpc_address) for n, a in fleet.agents.items()}
    astubs = {n: agent_pb2_grpc.AgentStub(ch) for n, ch in achans.items()}

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=30) as client:
            while True:
                with tally.lock:
                    if tally.requests >= total:
                        return
                which = rng.random()
                if which < 0.45:
                    kind, fn = rng.choice(rest)
                    _rest_call(tally, kind, fn, client)
                elif which < 0.75:
                    kind, method, make = rng.choice(trainer)
                    _grpc_call(tally, kind, getattr(tstub, method), make())
                else:
                    kind, method, make = rng.choice(agent)
                    node = rng.choice(list(astubs))
                    _grpc_call(tally, kind, getattr(astubs[node], method), make(node))

    try:
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(worker, range(clients)))
    finally:
        tchan.close()
        for ch in achans.values():
            ch.close()


# ---- the running job and the decision prober ----


def _reporter(fleet: Fleet, ctl, stop: threading.Event) -> None:
    with grpc.insecure_channel(Fleet.trainer_endpoint(ctl)) as ch:
        stub = controller_pb2_grpc.TrainerStub(ch)
        step = 0
        while not stop.wait(0.1):
            step += 1
            plan = fleet.plan()
            gen = plan.generation if plan else 1
            for replica in (0, 1):
                try:
                    stub.ReportStep(_report(replica=replica, rank=4 * replica, step=step, generation=gen,
                                            step_seconds=0.08), timeout=5)
                except grpc.RpcError:
                    pass


def _uses(fleet: Fleet, gpu) -> bool:
    plan = fleet.plan()
    return any((g.node, g.index) == gpu for r in plan.replicas for s in r.stages for g in s.gpus)


def probe_decisions(fleet: Fleet, stop: threading.Event, samples: list[float], limit: int = 0) -> None:
    """Fail and repair PROBE_GPU in turn; each time, ms from the injection until the
    committed plan reflects it."""
    failed = False
    while not stop.is_set() and (not limit or len(samples) < limit):
        t0 = time.monotonic()
        fleet.inject(*PROBE_GPU, "recover" if failed else "xid79")
        failed = not failed
        deadline = t0 + 30
        while _uses(fleet, PROBE_GPU) == failed and time.monotonic() < deadline:
            time.sleep(0.002)
        samples.append((time.monotonic() - t0) * 1000)
        stop.wait(0.3)
    if failed:
        fleet.inject(*PROBE_GPU, "recover")


def watch_invariants(fleet: Fleet, ctl, stop: threading.Event, found: list[str]) -> None:
    while not stop.wait(2.0):
        found += _violations(fleet, ctl)


def _violations(fleet: Fleet, ctl) -> list[str]:
    agents = {n: a.grpc_address for n, a in fleet.agents.items()}
    out = invariants.settle(lambda: invariants.plan_violations(fleet.etcd), 5.0)
    out += invariants.settle(lambda: invariants.cap_violations(fleet.etcd, agents), 5.0)
    out += invariants.stored_nonfinite(fleet.etcd)
    out += invariants.served_violations(ctl.rest_url)
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _children(pid: int) -> list[int]:
    """The running child processes of ``pid`` (/proc; the controller's only one is its
    REST process)."""
    return [k for k in procfs.children(pid) if _alive(k)]


def _plant_kill_rest_child(ctl, tally: Tally, stop: threading.Event, killed: list[int]) -> None:
    """The planted defect ``kill-rest-child``: SIGKILL the REST child halfway through."""
    while not tally.halfway.wait(0.5):
        if stop.is_set():
            return
    for pid in _children(ctl.proc.pid):
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
        print(f"# planted kill-rest-child: SIGKILL pid {pid} after {tally.requests} requests", file=sys.stderr)


def _peak_rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return -1.0


def run(total: int, clients: int, baseline_decisions: int, plant: str | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="tpflex-abuse-") as tmp:
        base = Path(tmp)
        cluster = EtcdCluster(1, base / "etcd").start()
        fleet = Fleet(cluster.endpoints, base, agent_ttl=10)
        stop = threading.Event()
        try:
            fleet.start_agents()
            fleet.put_job()
            ctl = fleet.start_controller("c1")
            ctl.wait_http()
            fleet.wait_generation(1, timeout=30)
            fleet.start_ranks([Fleet.trainer_endpoint(ctl)])
            threading.Thread(target=_reporter, args=(fleet, ctl, stop), daemon=True).start()
            quiet: list[float] = []
            probe_decisions(fleet, threading.Event(), quiet, limit=baseline_decisions)
            tally, during, found, killed = Tally(half=total // 2), [], [], []
            # the REST child as the controller logged it and as /proc shows it: a restart
            # under abuse (the listening socket survives it) is a server error
            rest_logged, rest_running = ctl.rest_pids(), _children(ctl.proc.pid)
            helpers = [threading.Thread(target=probe_decisions, args=(fleet, stop, during), daemon=True),
                       threading.Thread(target=watch_invariants, args=(fleet, ctl, stop, found), daemon=True)]
            if plant == "kill-rest-child":
                helpers.append(threading.Thread(target=_plant_kill_rest_child, args=(ctl, tally, stop, killed),
                                                daemon=True))
            for t in helpers:
                t.start()
            t0 = time.monotonic()
            abuse(fleet, ctl, total, clients, tally)
            abuse_s = time.monotonic() - t0
            stop.set()
            for t in helpers:
                t.join(60)
            rest_errors, restarts = max(rest_child_errors(rest_logged, ctl.rest_pids(), _alive),
                                        rest_child_errors(rest_running, _children(ctl.proc.pid), _alive))
            try:
                httpx.post(f"{ctl.rest_url}/v1/nodes/{CHURN_GPU[0]}/gpus/{CHURN_GPU[1]}/undrain",
                           headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
            except httpx.TransportError as exc:  # counted: the REST process is gone
                print(f"# undrain after the abuse failed: {exc!r}", file=sys.stderr)
            found += _violations(fleet, ctl)
            alive = ctl.proc.poll() is None and all(a.proc.poll() is None for a in fleet.agents.values())
            result = {
                "requests": tally.requests,
                "server_errors": tally.outcomes["SERVER_ERROR"] + rest_errors + (0 if alive else 1),
                "transport_errors": tally.outcomes["TRANSPORT_ERROR"],
                "rest_child_restarts": restarts,
                "invariant_violations": len(found),
                "rss_peak_mb": _peak_rss_mb(ctl.proc.pid),
                "rest_rss_peak_mb": max((_peak_rss_mb(pid) for pid in ctl.rest_pids() if _alive(pid)), default=None),
                "decision_p99_ms_during_abuse": _pct(during, 0.99),
            }
            detail = {"abuse_s": round(abuse_s, 1), "requests_per_s": round(tally.requests / abuse_s, 1),
                      "decisions_during_abuse": len(during), "decision_p50_ms_during_abuse": _pct(during, 0.5),
                      "decision_p99_ms_quiet": _pct(quiet, 0.99), "decision_p50_ms_quiet": _pct(quiet, 0.5),
                      "decision_p99_ratio_abuse_vs_quiet": round(_pct(during, 0.99) / max(_pct(quiet, 0.99), 1e-9), 2),
                      "processes_alive": alive, "planted": plant, "rest_children_killed": killed,
                      "violations": found[:10], "server_error_samples": tally.server_errors,
                      "outcomes": dict(sorted(tally.outcomes.items()))}
            print(json.dumps(detail), file=sys.stderr)
            return result
        finally:
            stop.set()
            fleet.close()
            cluster.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=10_000, help="hostile requests to send (default %(default)s)")
    p.add_argument("--clients", type=int, default=8, help="concurrent hostile clients (default %(default)s)")
    p.add_argument("--baseline-decisions", type=int, default=10,
                   help="decisions timed before the abuse starts (default %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="200 requests, 4 clients, 2 baseline decisions (the same JSON keys)")
    a = p.parse_args(argv)
    if a.quick:
        a.requests, a.clients, a.baseline_decisions = 200, 4, 2
    if a.requests < 1 or a.clients < 1:
        p.error("--requests and --clients must be >= 1")
    try:
        plant = planted()
    except ValueError as exc:
        p.error(str(exc))
    print(json.dumps(run(a.requests, a.clients, a.baseline_decisions, plant)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
