"""Load: 10,000 simulated nodes on a real etcd against a real ``tpflex-controller`` process.

The nodes live in this process: each has its own etcd lease, a registration and a health
record bound to it; the leases are renewed from a process of their own
(``bench/lease_keeper.py``), so that the checks here cannot starve them. An injector fails
and recovers GPUs at ``--rate`` events per minute (half failures, half recoveries of a
GPU failed earlier) for ``--minutes``; meanwhile 200 REST clients read the API.
Afterwards every committed plan is checked offline against ``tpflex_controller.planner
.plan``: a decision is right when it equals the planner's output on a state the job's
inputs (health writes, node losses) passed through, written before its commit and not
before the state its previous decision matched (the earliest match:
``bench/load_oracle.follow``), and after the run settles every job's last plan equals the
planner's output on the final state.

Besides, ``bench/load_oracle.py`` checks every plan against invariants it computes itself,
without planner code (no failed GPU, degree = usable GPUs, caps within the GPU's limits
and the rack budget, contiguous generations): ``invariant_violations``.

Prints one JSON line: ``nodes``, ``decisions_checked``, ``decisions_wrong``,
``invariant_violations``, ``failure_to_commit_p99_ms`` (health write of a failed GPU the
job's plan uses -> the first plan of that job without it, seen by a watcher; a failure no
plan reflects within ``--reflect-deadline-s`` is a miss, counted in
``failures_unreflected`` and in the p99s as the deadline, or as its latency when a plan
reflected it later; one recovered within the deadline before a plan reflected it counts
in ``failures_superseded``: ``failure_to_commit``),
``rss_after_warmup_mb`` (controller VmRSS after the first minute of injection),
``rss_start_mb`` / ``rss_end_mb`` (controller VmRSS after the first plans / at the end; the
controller process only: the REST API runs in its child process, whose VmRSS is
``rest_rss_*_mb``), ``leases_expired`` / ``lease_renew_lag_max_s`` (leases lost; the worst
time between two renewals of a lease) and ``nodes_lost`` (nodes whose keys were deleted:
the oracle counts them as lost from that revision), ``rest_cache_hit_ratio`` (the REST process's response cache:
hits and shared renders over cacheable GETs, from its /metrics after the paced load),
``rest_p99_ms`` (the realistic load: ``--rest-clients`` users, each polling at
``--rest-rate`` requests a second on a fixed open-loop schedule, from
``bench/rest_clients.py`` in its own process; ``rest_offered_rps``,
``rest_achieved_rps`` and ``rest_generator_lag_p99_ms`` say what it was), then the
saturating load (the same clients back to back, no think time):
``rest_saturated_rps`` / ``rest_saturated_p99_ms``. The paced load runs in cycles of ON
seconds of load and OFF seconds of none (``--rest-on-off``, ``rest_on_off_s``, after the
first minute): ``failure_to_commit_p99_ms_during_rest_load`` covers failures written in its
ON windows, ``..._without_rest_load`` those written in the OFF windows between them, so
that both come from one interleaved stretch of the run rather than from its different
halves (``..._outside_rest_phases``: those outside both loads, the warm-up included);
plus the run's parameters and baselines measured in the same run (``etcd_put_p99_ms``,
``rest_single_client_p99_ms``).

Debugging: ``TPFLEX_LOAD_DEBUG=1`` prints each wrong decision (with the states it was
judged on) and the controller's log; ``TPFLEX_LOAD_DUMP=<file>`` pickles the checks' inputs
(racks, jobs, every plan with its commit revision, the health writes, the node losses) to
judge them again offline; ``TPFLEX_MEMTRACE_FRAMES=N`` (controller/.../memtrace.py) reaches
the controller and slows it down: an honest way to make it lag (issue 14).

``TPFLEX_BENCH_PLANT=drop-failure`` plants a defect to see the accounting catch it: the
injector's first failure of a GPU a job uses goes into its ledger but not into etcd (the
health records it writes leave that GPU healthy, and it is never recovered), as a failure
lost on its way to the controller; ``failures_unreflected`` counts it.

Default ``--minutes 1`` (the issue's figures: ``--minutes 10``). ``--quick``: one job on
576 nodes, 7 s of injection, 4 REST clients (the same keys, seconds; for the test suite,
its figures are not the measurement's; it still exits 1 on a wrong decision). Loopback only; every
process it starts is stopped at the end; bounded in count and time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import httpx
from tpflex_controller import convert, synthetic
from tpflex_controller.planner import plan as planner_plan
from tpflex_controller.planner.model import ClusterState, GpuStatus
from tpflex_proto import codec, keys, planstore, types_pb2
from tpflex_proto.etcd import Etcd, EtcdError, Op

from bench import plants
from bench.lease_keeper import LeaseKeeper
from bench.load_oracle import InvariantOracle, JobState, follow, job_states
from bench.rest_clients import parse_on_off
from tests.support import procfs
from tests.support.etcd_server import EtcdCluster
from tests.support.ports import free_ports

NODES_PER_RACK, GPUS_PER_NODE, RACKS_PER_JOB = 18, 4, 32
LEASE_TTL_S = 60


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, round(q * (len(xs) - 1)))], 2) if xs else -1.0


class NodeFleet:
    """Simulated nodes: leases, registrations, health records; failures injected here."""

    def __init__(self, etcd: Etcd, racks: list[types_pb2.Rack], plant: str | None = None,
                 plant_nodes: frozenset[str] = frozenset()) -> None:
        self.etcd = etcd
        self.node_rack = {n: r.name for r in racks for n in r.nodes}
        # the planted defect ``drop-failure``: the first failure on one of ``plant_nodes``
        # is recorded in the ledger (events) but never written to etcd, and never recovered
        self.plant = plant
        self._plant_nodes = plant_nodes
        self.dropped: set[tuple[str, int]] = set()
        self.leases: dict[str, int] = {}
        self.failed: dict[str, set[int]] = {n: set() for n in self.node_rack}
        self.seq = 0
        # rev, t, node, failed set after, is_failure, the GPU index failed or recovered
        self.events: list[tuple[int, float, str, frozenset[int], bool, int]] = []
        self.granted: dict[str, float] = {}  # node -> wall-clock time its lease was granted
        self.lost: set[str] = set()  # nodes whose lease is gone (their keys deleted)
        self._keeper: LeaseKeeper | None = None

    def register(self, batch: int = 64) -> None:
        nodes = list(self.node_rack)
        for n in nodes:
            self.leases[n] = self.etcd.grant_lease(LEASE_TTL_S)
            self.granted[n] = time.time()
        for i in range(0, len(nodes), batch):
            ops = []
            for n in nodes[i:i + batch]:
                reg = synthetic.node(n, self.node_rack[n], GPUS_PER_NODE, f"{n}:1")
                health = synthetic.failed_health(n, GPUS_PER_NODE, set())
                ops += [Op.put(keys.node(n), codec.encode(reg), self.leases[n]),
                        Op.put(keys.health(n), codec.encode(health), self.leases[n])]
            self.etcd.txn([], ops)

    def start_keepalive(self, endpoints: list[str]) -> None:
        """Renew every node's lease from a process of its own (bench/lease_keeper.py), as
        10,000 separate agents would: the checks and watchers here must not starve it."""
        self._keeper = LeaseKeeper(endpoints, {lease: self.granted[n] for n, lease in self.leases.items()},
                                   LEASE_TTL_S)

    def stop(self) -> dict:
        """Stop renewing; the keeper's figures (``lease_keepalives``, ``leases_expired``,
        ``lease_renew_lag_max_s``, ...)."""
        keeper, self._keeper = self._keeper, None
        return keeper.stop() if keeper is not None else {}

    def _recoverable(self, node: str) -> bool:
        return any((node, g) not in self.dropped for g in self.failed[node])

    def inject(self, rng: random.Random) -> None:
        """Fail a healthy GPU, or recover a failed one (about half each)."""
        down = [n for n, f in self.failed.items() if self._recoverable(n)] if rng.random() < 0.5 else []
        if down:
            node = rng.choice(down)
            gpu = rng.choice(sorted(g for g in self.failed[node] if (node, g) not in self.dropped))
            self.failed[node].discard(gpu)
            failure = False
        else:
            node = rng.choice(list(self.node_rack))
            idle = [i for i in range(GPUS_PER_NODE) if i not in self.failed[node]]
            if not idle:
                return
            gpu = rng.choice(idle)
            self.failed[node].add(gpu)
            failure = True
        if node in self.lost:  # its lease lapsed: no agent writes its health any more
            return
        if failure and self.plant == "drop-failure" and not self.dropped and node in self._plant_nodes:
            self.dropped.add((node, gpu))
            print(f"# planted drop-failure: {node} GPU {gpu} failed in the ledger, not in etcd", file=sys.stderr)
        self.seq += 1
        written = {g for g in self.failed[node] if (node, g) not in self.dropped}
        health = synthetic.failed_health(node, GPUS_PER_NODE, written, self.seq)
        t = time.monotonic()
        try:
            rev = self.etcd.put(keys.health(node), codec.encode(health), lease=self.leases[node])
        except EtcdError as exc:
            if "lease not found" not in str(exc.__cause__):
                raise
            self.lost.add(node)  # lapsed before the node log saw its keys go
            return
        self.events.append((rev, t, node, frozenset(self.failed[node]), failure, gpu))


class NodeLog:
    """Nodes whose registration or health record was deleted (a lapsed or revoked lease),
    with the revision of the first deletion, as an independent watcher sees it; adds them
    to ``lost`` (the fleet's set) as they go."""

    def __init__(self, etcd: Etcd, lost: set[str]) -> None:
        self.gone: dict[str, int] = {}
        self._lost = lost
        self._watches = [etcd.watch_prefix(p, self._on_events) for p in (keys.NODES, keys.HEALTH)]
        for w in self._watches:
            w.established.wait(10)

    def _on_events(self, events) -> None:
        for ev in events:
            k = keys.parse(ev.key)
            if ev.kind == "delete" and k is not None and k.kind in (keys.Kind.NODE, keys.Kind.HEALTH):
                self.gone.setdefault(k.name, ev.mod_revision)
                self._lost.add(k.name)

    def losses(self) -> list[tuple[int, str]]:
        """(revision, node) of every node lost so far, in revision order."""
        return sorted((rev, n) for n, rev in dict(self.gone).items())

    def close(self) -> None:
        for w in self._watches:
            w.cancel()


class PlanLog:
    """Every plan generation of every job, as an independent watcher sees it."""

    def __init__(self, etcd: Etcd) -> None:
        self.plans: dict[str, list[tuple[int, float, types_pb2.Plan]]] = {}
        self.last_arrival = time.monotonic()
        self._lock = threading.Lock()
        self._folders: dict[str, planstore.JobPlans] = {}
        self._watch = etcd.watch_prefix(keys.JOBS, self._on_events)
        self._watch.established.wait(10)

    def _on_events(self, events) -> None:
        now = time.monotonic()
        for ev in events:
            k = keys.parse(ev.key)
            if k is None or k.kind not in (keys.Kind.JOB_PLAN, keys.Kind.JOB_ASSIGN):
                continue
            job = k.name
            folder = self._folders.setdefault(job, planstore.JobPlans(job))
            plan = folder.fold(ev.key, ev.value, ev.kind == "delete")  # headers and parts
            if plan is not None:
                with self._lock:
                    self.plans.setdefault(job, []).append((ev.mod_revision, now, plan))
                    self.last_arrival = now

    def count(self) -> int:
        with self._lock:
            return sum(len(v) for v in self.plans.values())

    def close(self) -> None:
        self._watch.cancel()


def _seed(etcd: Etcd, nodes: int) -> tuple[list[types_pb2.Rack], dict[str, types_pb2.JobSpec]]:
    racks = [synthetic.rack(f"r{i:04d}", NODES_PER_RACK, GPUS_PER_NODE)
             for i in range((nodes + NODES_PER_RACK - 1) // NODES_PER_RACK)]
    extra = len(racks) * NODES_PER_RACK - nodes  # trim the last rack to the node count
    if extra:
        last = racks[-1]
        del last.nodes[len(last.nodes) - extra:]
    for i in range(0, len(racks), 64):
        etcd.txn([], [Op.put(keys.rack(r.name), codec.encode(r)) for r in racks[i:i + 64]])
    jobs = {}
    full = [r for r in racks if len(r.nodes) == NODES_PER_RACK]
    for j in range(len(full) // RACKS_PER_JOB):
        names = [r.name for r in full[j * RACKS_PER_JOB:(j + 1) * RACKS_PER_JOB]]
        spec = synthetic.job(f"job{j:02d}", names, NODES_PER_RACK * GPUS_PER_NODE, min_tp=1)
        etcd.put(keys.job_spec(spec.name), codec.encode(spec))
        jobs[spec.name] = spec
    return racks, jobs


PLANTS = ("drop-failure",)


def planted(env: dict | None = None) -> str | None:
    """The defect ``TPFLEX_BENCH_PLANT`` asks this bench to plant (``bench.plants``)."""
    return plants.planted("load.py", PLANTS, env)


def _default_rest_nice() -> int:
    from tpflex_controller.settings import RestSection

    return RestSection.model_fields["nice"].default


def _start_controller(endpoints: list[str], workdir: Path, rest_nice: int | None = None,
                      rest_cpus: str = "", controller_cpus: str = "") -> tuple[subprocess.Popen, str]:
    rest_port, trainer_port = free_ports(2)
    # the controller's settings are the bench's; debug switches pass (TPFLEX_DEBUG_*, and
    # TPFLEX_MEMTRACE_FRAMES: tracemalloc in the controller, a way to make it lag)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TPFLEX_") or k.startswith("TPFLEX_DEBUG_") or k == "TPFLEX_MEMTRACE_FRAMES"}
    env["TPFLEX_CONTROLLER__FLAP_HOLD_DOWN_S"] = "0"  # every change is a decision to check
    env["TPFLEX_CONTROLLER__LOG_LEVEL"] = "WARNING"
    if rest_nice is not None:  # else the controller's default (rest.nice)
        env["TPFLEX_REST__NICE"] = str(rest_nice)
    if rest_cpus:  # rest.cpus: the REST process pinned there
        env["TPFLEX_REST__CPUS"] = rest_cpus
    log = open(workdir / "controller.log", "wb")
    # --controller-cpus: as systemd's CPUAffinity= places it (its REST child moves itself
    # to rest.cpus when set, else inherits this)
    pin = ["taskset", "-c", controller_cpus] if controller_cpus else []
    proc = subprocess.Popen(
        [*pin, str(Path(sys.executable).parent / "tpflex-controller"), "--name", "load",
         "--etcd", ",".join(endpoints), "--rest-listen", f"127.0.0.1:{rest_port}",
         "--trainer-listen", f"127.0.0.1:{trainer_port}"], stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{rest_port}"


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return -1.0


def _clients(url: str, paths: list[str], *extra: str, nice: int = 0) -> dict:
    """Run bench/rest_clients.py in its own processes (``nice`` added to their niceness);
    its JSON line."""
    root = str(Path(__file__).resolve().parent.parent)
    cmd = [sys.executable, "-m", "bench.rest_clients", "--url", url, "--paths", ",".join(paths), *extra]
    env = {**os.environ, "PYTHONPATH": root}
    # its own session: the bench stops the generator and its workers as one group
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root,
                            env=env, start_new_session=True, preexec_fn=(lambda: os.nice(nice)) if nice else None)
    _GENERATORS.append(proc)
    out, err = proc.communicate(timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"rest_clients failed: {err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


_GENERATORS: list[subprocess.Popen] = []


def _stop_generators() -> None:
    for proc in _GENERATORS:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


# ---- offline check against the planner ----


class DecisionChecker:
    """Each committed plan against ``tpflex_controller.planner.plan`` on the states the
    job's inputs passed through (``bench/load_oracle.job_states``: health writes and node
    losses, a lost node neither live nor reporting health, as the controller sees it)."""

    def __init__(self, racks: list[types_pb2.Rack], jobs: dict[str, types_pb2.JobSpec],
                 nodes: list[str]) -> None:
        self.racks = {r.name: convert.rack_info(r) for r in racks}
        self.node_rack = {n: r.name for r in racks for n in r.nodes}
        self.live = frozenset(nodes)
        self.specs = {name: convert.job_spec(spec, self.racks) for name, spec in jobs.items()}
        self.job_racks = {name: {st.rack for rep in spec.replicas for st in rep.stages}
                          for name, spec in jobs.items()}

    def expected(self, job: str, failed: dict[str, frozenset[int]], lost: frozenset[str] = frozenset()):
        status = {(n, i): GpuStatus.FAILED for n, idx in failed.items() if n not in lost for i in idx}
        state = ClusterState(racks=self.racks, gpu_status=status, live_nodes=self.live - lost)
        return planner_plan(state, self.specs[job])

    def states(self, job: str, events, losses=()) -> list[JobState]:
        return job_states(events, losses, lambda n: self.node_rack[n] in self.job_racks[job])

    def check(self, job: str, plans, events, losses=()) -> tuple[int, int]:
        """(checked, wrong) for one job's plan sequence: decision i must equal the
        planner's output on a state its inputs passed through, not before the one
        decision i-1 matched and written before decision i's commit
        (``bench/load_oracle.follow``)."""
        states = self.states(job, events, losses)
        memo: dict[int, object] = {}

        def passes(decision, k: int) -> bool:
            for old in [i for i in memo if i < k - 64]:  # the states left behind
                del memo[old]
            if k not in memo:
                memo[k] = self.expected(job, states[k].failed, states[k].lost)
            return memo[k].same_decision(decision)

        decisions = [(rev, t, convert.plan_from_proto(p)) for rev, t, p in plans]
        checked = wrong = 0
        for (_, _, proto), j in zip(plans, follow(decisions, states, passes), strict=True):
            checked += 1
            if j.match is not None:
                continue
            wrong += 1
            if os.environ.get("TPFLEX_LOAD_DEBUG"):
                exp = self.expected(job, states[j.upper].failed, states[j.upper].lost)
                diff = [(a.index, a.tp_degree, b.tp_degree)
                        for a, b in zip(exp.replicas, j.plan.replicas, strict=False) if a != b]
                anywhere = [k for k in range(len(states)) if passes(j.plan, k)]
                print(f"wrong decision job={job} generation={proto.generation} cause={proto.cause} "
                      f"rev={j.revision} states={j.lower}..{j.upper} replica_diffs={diff[:5]} matches_at={anywhere} "
                      f"state_revs={[st.revision for st in states[max(0, j.lower - 3):j.upper + 2]]}",
                      file=sys.stderr)
        return checked, wrong

    def check_final(self, job: str, plans, events, losses=()) -> bool:
        """Whether the job's last plan is the planner's output on the final state."""
        last = self.states(job, events, losses)[-1]
        exp = self.expected(job, last.failed, last.lost)
        ok = bool(plans) and exp.same_decision(convert.plan_from_proto(plans[-1][2]))
        if not ok and plans and os.environ.get("TPFLEX_LOAD_DEBUG"):
            got = convert.plan_from_proto(plans[-1][2])
            print(f"final mismatch job={job} generation={plans[-1][2].generation}", file=sys.stderr)
            for a, b in zip(exp.replicas, got.replicas, strict=False):
                if a != b:
                    print(f"  expected {a}\n  got      {b}", file=sys.stderr)
            print(f"  caps equal={dict(exp.power_caps) == dict(got.power_caps)} policy {exp.policy} {got.policy}", file=sys.stderr)
        return ok


def _uses(plan: types_pb2.Plan, node: str, gpu: int) -> bool:
    return any(g.node == node and g.index == gpu for rep in plan.replicas for st in rep.stages for g in st.gpus)


class Reflection(NamedTuple):
    """Failure -> commit over a set of failures (``failure_to_commit``)."""

    samples_ms: list[float]  # one per failure judged; a miss counts as the deadline (or later)
    unreflected: int  # misses: failures no plan reflected within the deadline
    superseded: int  # recovered within the deadline before a plan reflected them


def failure_to_commit(events, plans: dict[str, list], job_racks: dict[str, set[str]],
                      node_rack: dict[str, str], deadline_s: float,
                      windows: list[tuple[float, float]] | None = None, inside: bool = True) -> Reflection:
    """Per failure of a GPU the job's current plan uses (``events``: the injector's ledger,
    (revision, monotonic time, node, failed set after, is failure, GPU); ``plans``: job ->
    (commit revision, arrival time, plan) in commit order): ms from the health write until
    the first plan of that job without the GPU, the first that reflects the failure, up to
    the GPU's next failure. A failure no plan reflects within ``deadline_s`` is a miss: it
    counts in ``unreflected`` and as a sample of its latency if a plan reflected it later,
    else of the deadline, so a failure never reflected raises the p99 instead of vanishing
    from it (whether or not the watch lasted until its deadline: the bench watches until
    the controller settles). One recovered within the deadline before any plan reflected it
    (the controller may decide on the state after both) counts in ``superseded`` only.
    Only failures written inside one of (or outside all of) ``windows`` (monotonic start,
    end) when given."""
    if not deadline_s > 0:
        raise ValueError(f"deadline_s must be > 0, got {deadline_s!r}")
    samples: list[float] = []
    unreflected = superseded = 0
    later: dict[str, list] = {}  # node -> its events, in order
    for e in events:
        later.setdefault(e[2], []).append(e)
    seen: dict[str, int] = {}
    for rev, t, node, _, failure, gpu in events:
        k = seen[node] = seen.get(node, -1) + 1  # this event's place in its node's list
        if not failure or (windows is not None and any(a <= t <= b for a, b in windows) != inside):
            continue
        # the GPU's recovery and its next failure, from the ledger
        recovered_at, refailed_rev = None, None
        for e in later[node][k + 1:]:
            if recovered_at is None and gpu not in e[3]:
                recovered_at = e[1]
            elif recovered_at is not None and gpu in e[3]:
                refailed_rev = e[0]
                break
        for j, rs in job_racks.items():
            if node_rack[node] not in rs:
                continue
            job_plans = plans.get(j, [])
            current = next((p for r, _, p in reversed(job_plans) if r < rev), None)
            if current is None or not _uses(current, node, gpu):
                continue  # nothing to decide: the plan does not use the GPU
            nxt = next((arr for r, arr, p in job_plans
                        if r > rev and (refailed_rev is None or r < refailed_rev) and not _uses(p, node, gpu)), None)
            ms = (nxt - t) * 1000 if nxt is not None else None
            if ms is not None and ms <= deadline_s * 1000:
                samples.append(ms)
            elif recovered_at is not None and recovered_at - t <= deadline_s:
                superseded += 1
            else:
                unreflected += 1
                samples.append(max(ms or 0.0, deadline_s * 1000))
    return Reflection(samples, unreflected, superseded)


def _failure_to_commit_ms(log: PlanLog, fleet: NodeFleet, checker: DecisionChecker, deadline_s: float,
                          windows: list[tuple[float, float]] | None = None, inside: bool = True) -> Reflection:
    """``failure_to_commit`` over the run's ledger and the plans the watcher saw."""
    return failure_to_commit(fleet.events, log.plans, checker.job_racks, fleet.node_rack, deadline_s,
                             windows, inside)


def rest_windows(on: list, off_s: float) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """The paced load's ON windows (``rest_clients``' ``windows``) and the OFF window after
    each (``off_s`` long): the stretches with and without REST load."""
    ons = [(float(a), float(b)) for a, b in on]
    return ons, [(b, b + off_s) for _, b in ons]


def _dump(path: Path, racks, jobs, plans, events, losses) -> None:
    """The offline checks' inputs as one pickle (debug: ``TPFLEX_LOAD_DUMP=path``)."""
    import pickle

    data = {"racks": [r.SerializeToString() for r in racks],
            "jobs": {n: s.SerializeToString() for n, s in jobs.items()},
            "plans": {j: [(rev, t, p.SerializeToString()) for rev, t, p in v] for j, v in plans.items()},
            "events": list(events), "losses": list(losses)}
    path.write_bytes(pickle.dumps(data))


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rest_pid(pid: int) -> int | None:
    """The controller's REST child process (api/process.py), None if there is none."""
    kids = procfs.children(pid)
    return kids[0] if kids else None


def _rest_into(out: dict, url: str, paths: list[str], args, pid: int) -> None:
    """The realistic REST load (open loop, paced), then the saturating one (closed loop)."""
    child = _rest_pid(pid)
    out["start"], cpu = time.monotonic(), _cpu_s(pid)
    rest_cpu = _cpu_s(child) if child else 0.0
    out["open"] = _clients(url, paths, "--mode", "open", "--clients", str(args.rest_clients),
                           "--rate", str(args.rest_rate), "--seconds", str(args.rest_seconds),
                           "--on-off", f"{args.rest_on_off[0]},{args.rest_on_off[1]}",
                           "--processes", str(args.rest_processes), nice=args.rest_generator_nice)
    windows = out["open"].get("windows") or []
    if windows:  # the last ON window's OFF window, before the saturating load
        time.sleep(max(0.0, windows[-1][1] + args.rest_on_off[1] - time.monotonic()))
    out["end"], out["cpu_s"] = time.monotonic(), _cpu_s(pid) - cpu
    out["rest_cpu_s"] = _cpu_s(child) - rest_cpu if child else -1.0
    out["cache"] = _cache_counts(url)
    out["saturated_start"] = time.monotonic()
    out["closed"] = _clients(url, paths, "--mode", "closed", "--clients", str(args.rest_clients),
                             "--requests", str(args.rest_requests), "--processes", str(args.rest_processes))
    # baseline, same clients right after: /healthz (async, no state, no in-flight bound)
    # measures the HTTP stack (uvicorn h11 + httpx on loopback) without the API's work
    out["healthz"] = _clients(url, ["/healthz"], "--mode", "closed", "--clients", str(args.rest_clients),
                              "--requests", str(args.rest_requests), "--processes", str(args.rest_processes))
    out["saturated_end"] = time.monotonic()


def _cache_counts(url: str) -> dict[str, float]:
    """The REST process's response cache outcomes so far (tpflex_rest_response_cache_total)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("tpflex_rest_response_cache_total{"):
            label, _, value = line.partition("} ")
            out[label.split('"')[1]] = float(value)
    return out


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def _hit_ratio(counts: dict[str, float]) -> float:
    """Hits (and misses served by another request's render) over the cacheable requests,
    since the REST process started."""
    total = sum(counts.get(k, 0.0) for k in ("hits", "renders", "shared"))
    return round((counts.get("hits", 0.0) + counts.get("shared", 0.0)) / total, 3) if total else -1.0


def _run(args, workdir: Path) -> dict:
    rng = random.Random(args.seed)
    cluster = EtcdCluster(1, workdir / "etcd", ).start()
    etcd = Etcd(cluster.endpoints, timeout=10.0)
    procs: list[subprocess.Popen] = []
    fleet = None
    try:
        racks, jobs = _seed(etcd, args.nodes)
        job_racks = {st.rack for spec in jobs.values() for rep in spec.replicas for st in rep.stages}
        fleet = NodeFleet(etcd, racks, args.plant, frozenset(n for r in racks if r.name in job_racks for n in r.nodes))
        fleet.register()
        fleet.start_keepalive(cluster.endpoints)
        nodelog = NodeLog(etcd, fleet.lost)
        puts = []
        for _ in range(200):
            t = time.monotonic()
            etcd.put("/bench/put", b"x" * 200)
            puts.append((time.monotonic() - t) * 1000)
        log = PlanLog(etcd)
        ctl, url = _start_controller(cluster.endpoints, workdir, args.rest_nice, args.rest_cpus,
                                     args.controller_cpus)
        procs.append(ctl)
        _wait(lambda: len(log.plans) == len(jobs), 120, "initial plans")
        rss_start = _rss_mb(ctl.pid)
        rest_pid = _rest_pid(ctl.pid)
        rest_rss = {"start": _rss_mb(rest_pid) if rest_pid else -1.0}
        single = []
        with httpx.Client(base_url=url, timeout=30) as http:
            # the REST process has its own informer: it answers 503 until that has synced
            _wait(lambda: http.get("/readyz").status_code == 200, 120, "REST view synced")
            # what a dashboard or tpflexctl user polls: jobs and plans, the cluster summary,
            # a page of failed GPUs, of nodes and of racks, one node
            paths = [f"/v1/jobs/{j}/plan" for j in jobs] + [f"/v1/jobs/{j}" for j in jobs] + [
                "/v1/status", "/v1/gpus?state=failed&limit=100", "/v1/nodes?limit=100",
                "/v1/racks?limit=100", f"/v1/nodes/{next(iter(fleet.node_rack))}"]
            for i in range(50):
                t = time.monotonic()
                http.get(paths[i % len(paths)]).raise_for_status()
                single.append((time.monotonic() - t) * 1000)
            node_get = []
            for n in list(fleet.node_rack)[:5]:  # a one-node read (O(that node) from the cache)
                t = time.monotonic()
                http.get(f"/v1/nodes/{n}").raise_for_status()
                node_get.append((time.monotonic() - t) * 1000)
        rest: dict = {}
        end = time.monotonic() + args.minutes * 60
        # the paced REST load starts after the warm-up (or a quarter of a short run)
        rest_at = time.monotonic() + min(60.0, args.minutes * 60 * 0.25)
        rest_thread = None
        warmup_at, rss_warm = time.monotonic() + 60.0, -1.0
        interval = 60.0 / args.rate
        nxt = time.monotonic()
        while time.monotonic() < end:
            fleet.inject(rng)
            if rss_warm < 0 and time.monotonic() >= warmup_at:
                rss_warm = _rss_mb(ctl.pid)  # after the first minute of injection
                rest_rss["warm"] = _rss_mb(rest_pid) if rest_pid else -1.0
            if rest_thread is None and time.monotonic() >= rest_at:
                rest["rss_before_mb"] = _rss_mb(ctl.pid)
                rest_thread = threading.Thread(target=_rest_into, args=(rest, url, paths, args, ctl.pid), daemon=True)
                rest_thread.start()
            nxt += interval
            time.sleep(max(0.0, nxt - time.monotonic()))
        if rest_thread is not None:
            rest_thread.join(300)
        last_rev = fleet.events[-1][0] if fleet.events else 0
        injected_at = time.monotonic()
        checker = DecisionChecker(racks, jobs, list(fleet.node_rack))

        def settled() -> bool:  # every job at the planner's answer, or 10 s without a plan
            if time.monotonic() - log.last_arrival > 10.0:
                return True
            with log._lock:
                snapshot = {j: list(v) for j, v in log.plans.items()}
            lost = nodelog.losses()
            return all(checker.check_final(j, snapshot.get(j, []), fleet.events, losses=lost) for j in jobs)

        _wait(settled, 120, "controller settled")
        settle_ms = (time.monotonic() - injected_at) * 1000
        # judge the plans and node losses of the run: the watchers stop here, so what
        # happens while the checks run (minutes in a 10-minute run) is not mixed in
        log.close()
        nodelog.close()
        with log._lock:
            plans = {j: list(v) for j, v in log.plans.items()}
        losses = nodelog.losses()
        if os.environ.get("TPFLEX_LOAD_DUMP"):  # debug: the checkers' inputs, to judge offline
            _dump(Path(os.environ["TPFLEX_LOAD_DUMP"]), racks, jobs, plans, fleet.events, losses)
        rss_end = _rss_mb(ctl.pid)
        rest_rss["end"] = _rss_mb(rest_pid) if rest_pid else -1.0
        checked = wrong = final_wrong = 0
        checks_at = time.monotonic()
        for job in jobs:
            c, w = checker.check(job, plans.get(job, []), fleet.events, losses=losses)
            checked, wrong = checked + c, wrong + w
            final_wrong += not checker.check_final(job, plans.get(job, []), fleet.events, losses=losses)
        oracle = InvariantOracle(racks, jobs)
        violations = [v for job in jobs for v in oracle.check(job, plans.get(job, []), fleet.events, losses)]
        for v in violations[:10]:
            print(f"# invariant violated: {v}", file=sys.stderr)
        checks_s = time.monotonic() - checks_at  # the offline checks (one CPU-bound thread here)
        deadline = args.reflect_deadline_s
        reflection = _failure_to_commit_ms(log, fleet, checker, deadline)
        f2c = reflection.samples_ms
        window = (rest["start"], rest["end"]) if "end" in rest else None
        saturated = (rest["saturated_start"], rest["saturated_end"]) if "saturated_end" in rest else None
        loaded = [w for w in (window, saturated) if w is not None]
        # with and without REST load: the paced load's ON windows and the OFF windows between
        # them, interleaved over one stretch, so that both sides see the same drift of this
        # machine (a run's first and second halves differed by up to 3x in p99 on their own)
        on, off = rest_windows(rest.get("open", {}).get("windows", []), args.rest_on_off[1])
        f2c_quiet = _failure_to_commit_ms(log, fleet, checker, deadline, off, inside=True).samples_ms if off else []
        f2c_rest = _failure_to_commit_ms(log, fleet, checker, deadline, on, inside=True).samples_ms if on else []
        f2c_outside = _failure_to_commit_ms(log, fleet, checker, deadline, loaded, inside=False).samples_ms
        f2c_saturated = (_failure_to_commit_ms(log, fleet, checker, deadline, [saturated], inside=True).samples_ms
                         if saturated else [])
        paced, closed, healthz = rest.get("open", {}), rest.get("closed", {}), rest.get("healthz", {})
        alive = ctl.poll() is None
        ctl_log = (workdir / "controller.log").read_text(errors="replace")
        log_errors = ctl_log.count(" ERROR ")
        if os.environ.get("TPFLEX_LOAD_DEBUG") and (wrong or log_errors):
            sys.stderr.write(ctl_log[-12000:])
        lease = fleet.stop()  # after the checks: the renewal figures cover the whole run
        return {
            "nodes": args.nodes, "decisions_checked": checked, "decisions_wrong": wrong + final_wrong,
            "failure_to_commit_p99_ms": _pct(f2c, 0.99), "rss_start_mb": rss_start, "rss_end_mb": rss_end,
            "rss_after_warmup_mb": rss_warm, "invariant_violations": len(violations),
            "rss_end_vs_warmup_ratio": round(rss_end / rss_warm, 3) if rss_warm > 0 else -1.0,
            "rest_p99_ms": paced.get("p99_ms", -1.0), "rest_p50_ms": paced.get("p50_ms", -1.0),
            "rest_max_ms": paced.get("max_ms", -1.0),
            "rest_rate_per_client_rps": args.rest_rate, "rest_offered_rps": paced.get("offered_rps", -1.0),
            "rest_achieved_rps": paced.get("achieved_rps", -1.0),
            "rest_generator_lag_p99_ms": paced.get("lag_p99_ms", -1.0),
            "rss_before_rest_load_mb": rest.get("rss_before_mb", -1.0),
            "minutes": args.minutes, "events_per_minute": args.rate, "events": len(fleet.events),
            "gpus": args.nodes * GPUS_PER_NODE, "racks": len(racks), "jobs": len(jobs),
            "failure_to_commit_p50_ms": _pct(f2c, 0.5),
            "failure_to_commit_max_ms": round(max(f2c), 2) if f2c else -1.0,
            "failures_unreflected": reflection.unreflected, "failures_superseded": reflection.superseded,
            "failures_judged": len(f2c), "reflect_deadline_s": deadline, "planted": fleet.plant,
            "failure_to_commit_p99_ms_without_rest_load": _pct(f2c_quiet, 0.99),
            "failure_to_commit_p99_ms_during_rest_load": _pct(f2c_rest, 0.99),
            "failure_to_commit_p50_ms_without_rest_load": _pct(f2c_quiet, 0.5),
            "failure_to_commit_p50_ms_during_rest_load": _pct(f2c_rest, 0.5),
            "failure_to_commit_p99_ms_during_saturated_rest": _pct(f2c_saturated, 0.99),
            "failures_without_rest_load": len(f2c_quiet), "failures_during_rest_load": len(f2c_rest),
            "failure_to_commit_p99_ms_outside_rest_phases": _pct(f2c_outside, 0.99),
            "failures_outside_rest_phases": len(f2c_outside),
            "rest_on_off_s": list(args.rest_on_off), "rest_windows": len(on),
            "rest_load_s": round(sum(b - a for a, b in on), 1), "final_state_wrong": final_wrong,
            "rest_clients": args.rest_clients, "rest_requests": paced.get("requests", 0),
            "rest_errors": paced.get("errors", {}),
            "rest_saturated_rps": closed.get("achieved_rps", -1.0), "rest_saturated_p99_ms": closed.get("p99_ms", -1.0),
            "rest_saturated_errors": closed.get("errors", {}),
            "rest_single_client_p99_ms": _pct(single, 0.99),
            "rest_node_get_p50_ms": _pct(node_get, 0.5), "etcd_put_p99_ms": _pct(puts, 0.99),
            "rest_healthz_saturated_p99_ms": healthz.get("p99_ms", -1.0),
            "rest_healthz_saturated_rps": healthz.get("achieved_rps", -1.0),
            "controller_cpu_s_during_rest_load": round(rest.get("cpu_s", -1.0), 1),
            "rest_process_cpu_s_during_rest_load": round(rest.get("rest_cpu_s", -1.0), 1),
            "rest_generator_cpu_s": paced.get("cpu_s", -1.0), "rest_generator_nice": args.rest_generator_nice,
            "rest_process": rest_pid is not None, "rest_nice": args.rest_nice if args.rest_nice is not None else _default_rest_nice(),
            "rest_cpus": args.rest_cpus, "controller_cpus": args.controller_cpus,
            "rest_cache_hit_ratio": _hit_ratio(rest.get("cache", {})),
            "rest_rss_start_mb": rest_rss["start"], "rest_rss_after_warmup_mb": rest_rss.get("warm", -1.0),
            "rest_rss_end_mb": rest_rss["end"],
            "lease_keepalives": lease.get("lease_keepalives", -1), "leases_expired": lease.get("leases_expired", -1),
            "lease_renew_lag_max_s": lease.get("lease_renew_lag_max_s", -1.0),
            "lease_stream_errors": lease.get("lease_stream_errors", -1), "nodes_lost": len(losses),
            "controller_alive": alive, "controller_log_errors": log_errors, "last_event_revision": last_rev,
            "settle_after_injection_ms": round(settle_ms, 1), "offline_checks_s": round(checks_s, 1),
        }
    finally:
        _stop_generators()
        if fleet is not None:
            fleet.stop()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        etcd.close()
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=10_000)
    p.add_argument("--minutes", type=float, default=1.0, help="injection time (issue: 10)")
    p.add_argument("--rate", type=float, default=1000.0, help="GPU failures+recoveries per minute")
    p.add_argument("--rest-clients", type=int, default=200)
    p.add_argument("--rest-rate", type=float, default=0.5,
                   help="requests a second per REST client (open loop: a user polling every 2 s)")
    p.add_argument("--rest-seconds", type=float, default=None,
                   help="how long the paced REST load's stretch runs, ON and OFF windows together"
                   " (default: 60%% of the injection, at most 360 s)")
    p.add_argument("--rest-on-off", metavar="ON,OFF", default=None,
                   help="the paced load's cycle: ON seconds of load, OFF seconds of none; failure->commit"
                   " during and without REST load come from these windows (default: 10,10, shorter in"
                   " short runs)")
    p.add_argument("--rest-processes", type=int, default=1, help="processes of the REST load generator")
    p.add_argument("--rest-requests", type=int, default=5, help="saturation run: GETs per REST client")
    p.add_argument("--rest-nice", type=int, default=None, choices=range(20), metavar="0..19",
                   help="the controller's rest.nice (niceness of its REST process; default: the"
                   " controller's default)")
    p.add_argument("--rest-cpus", default="", metavar="CPULIST",
                   help="the controller's rest.cpus (the CPUs its REST process runs on, e.g. '1';"
                   " default: unpinned)")
    p.add_argument("--controller-cpus", default="", metavar="CPULIST",
                   help="run the controller on these CPUs (taskset; as systemd CPUAffinity= would;"
                   " default: unpinned)")
    p.add_argument("--rest-generator-nice", type=int, default=0, choices=range(20), metavar="0..19",
                   help="niceness of the paced REST load's generator (it stands for clients on other"
                   " machines; default 0: it competes for this machine's CPUs like any process)")
    p.add_argument("--seed", type=int, default=8)
    p.add_argument("--reflect-deadline-s", type=float, default=30.0,
                   help="a failure no plan reflects within this many seconds is a miss: it counts in"
                   " failures_unreflected and as this deadline (or its later latency) in the p99s"
                   " (default %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="one job on 576 nodes, 7 s of injection, 4 REST clients (the same JSON keys)")
    args = p.parse_args(argv)
    if args.quick:
        args.nodes, args.minutes, args.rate = 18 * RACKS_PER_JOB, 0.12, 120.0
        args.rest_clients, args.rest_rate, args.rest_seconds, args.rest_requests = 4, 2.0, 3.0, 2
        args.rest_on_off = args.rest_on_off or "1,1"
    if not (0 < args.reflect_deadline_s <= 600):
        p.error("--reflect-deadline-s: need 0 < seconds <= 600")
    try:
        args.plant = planted()
    except ValueError as exc:
        p.error(str(exc))
    if args.rest_seconds is None:
        args.rest_seconds = min(360.0, args.minutes * 60 * 0.6)
    if args.rest_on_off is None:  # at least three cycles, at most 20 s each: a slow patch
        half = min(10.0, args.rest_seconds / 6)  # of this VM (seconds) falls on both sides
        args.rest_on_off = (half, half)
    else:
        try:
            args.rest_on_off = parse_on_off(args.rest_on_off)
        except ValueError as exc:
            p.error(f"--rest-on-off: {exc}")
        if args.rest_on_off[1] == 0:  # the OFF windows are the baseline
            p.error("--rest-on-off: OFF must be more than 0 seconds")
    from tpflex_controller.cpus import check_allowed, parse_cpu_list

    for flag, value in (("--rest-cpus", args.rest_cpus), ("--controller-cpus", args.controller_cpus)):
        try:
            if value:
                check_allowed(parse_cpu_list(value))
        except ValueError as exc:
            p.error(f"{flag}: {exc}")
    if not (1 <= args.nodes <= 20_000 and 0 < args.minutes <= 10 and 0 < args.rate <= 10_000):
        p.error("need 1 <= nodes <= 20000, 0 < minutes <= 10, 0 < rate <= 10000")
    with tempfile.TemporaryDirectory(prefix="tpflex-load-") as d:
        result = _run(args, Path(d))
    print(json.dumps(result))
    ok = result["decisions_wrong"] == 0 and result["invariant_violations"] == 0 and result["failures_unreflected"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
