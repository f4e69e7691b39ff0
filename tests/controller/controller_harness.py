"""Helpers for the controller core's tests: an in-process controller (elector + reconcile
loop on a real etcd), a plan watcher backed by a real etcd watch, a small cluster."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from tpflex_controller import synthetic
from tpflex_controller.election import Elector
from tpflex_controller.metrics import ControllerMetrics
from tpflex_controller.reconcile import Reconciler
from tpflex_proto import codec, keys, planstore, types_pb2
from tpflex_proto.etcd import Etcd


class PlanWatcher:
    """Every generation of a job's plan, as a real etcd watch delivers it."""

    def __init__(self, etcd: Etcd, job: str) -> None:
        self._cv = threading.Condition()
        self.plans: list[types_pb2.Plan] = []
        self.arrivals: list[float] = []
        self._plans = planstore.JobPlans(job)
        kvs, rev = etcd.get_prefix(keys.job_prefix(job))
        current = self._plans.fold_read(kvs)
        if current is not None:
            self.plans.append(current)
            self.arrivals.append(time.monotonic())
        self._watch = etcd.watch_prefix(keys.job_prefix(job), self._on_events, start_revision=rev + 1)
        self._watch.established.wait(5)

    def _on_events(self, events) -> None:
        now = time.monotonic()
        with self._cv:
            for ev in events:
                plan = self._plans.fold(ev.key, ev.value, ev.kind == "delete")
                if plan is not None:
                    self.plans.append(plan)
                    self.arrivals.append(now)
            self._cv.notify_all()

    def latest(self) -> types_pb2.Plan | None:
        with self._cv:
            return self.plans[-1] if self.plans else None

    def wait_generation(self, generation: int, timeout: float = 10.0) -> types_pb2.Plan:
        with self._cv:
            ok = self._cv.wait_for(
                lambda: self.plans and self.plans[-1].generation >= generation, timeout
            )
            assert ok, f"plan generation {generation} not committed within {timeout}s; have {[p.generation for p in self.plans]}"
            return next(p for p in self.plans if p.generation >= generation)

    def close(self) -> None:
        self._watch.cancel()


@dataclass
class InProcessController:
    etcd: Etcd
    registry: CollectorRegistry
    reconciler: Reconciler
    elector: Elector
    stopped: bool = field(default=False)

    def stop(self, resign: bool = True) -> None:
        if not self.stopped:
            self.stopped = True
            self.elector.stop(resign=resign)
            self.reconciler.stop()
            self.etcd.close()


def start_controller(endpoints: list[str], identity: str = "c1", ttl: int = 2, **kw) -> InProcessController:
    etcd = Etcd(endpoints, timeout=2.0)
    registry = CollectorRegistry()
    metrics = ControllerMetrics(registry)
    reconciler = Reconciler(etcd, metrics, **kw)
    elector = Elector(
        etcd, identity, ttl=ttl, on_elected=reconciler.on_elected, on_deposed=reconciler.on_deposed
    )
    reconciler.start()
    elector.start()
    return InProcessController(etcd, registry, reconciler, elector)


def small_cluster(etcd: Etcd, racks: int = 2, nodes_per_rack: int = 2, gpus_per_node: int = 2,
                  agent_addresses: dict[str, str] | None = None, lease: int = 0) -> list[types_pb2.Rack]:
    rs = [synthetic.rack(f"rack{i}", nodes_per_rack, gpus_per_node) for i in range(racks)]
    synthetic.store_cluster(etcd, rs, agent_addresses=agent_addresses, lease=lease)
    return rs


def put_job(etcd: Etcd, racks: list[types_pb2.Rack], name: str = "job1", **kw) -> types_pb2.JobSpec:
    spec = synthetic.job(name, [r.name for r in racks], racks[0].domain_size, **kw)
    etcd.put(keys.job_spec(name), codec.encode(spec))
    return spec


@contextmanager
def controller_on_job(
    etcd_server, etcd: Etcd, *, lease: int = 0, shape: tuple[int, int, int] = (2, 2, 2),
    before_start: Callable[[list[types_pb2.Rack]], None] | None = None, **controller_kw
) -> Iterator[tuple[list[types_pb2.Rack], PlanWatcher, InProcessController]]:
    """A cluster of ``shape`` (racks, nodes per rack, GPUs per node; nodes on ``lease``,
    0 = none) with job1 on it, a watcher of job1's plan and an in-process controller
    (``controller_kw`` to :func:`start_controller`; ``before_start(racks)`` runs first,
    after the job is stored); the controller is stopped, then the watcher, on exit."""
    racks = small_cluster(etcd, *shape, lease=lease)
    put_job(etcd, racks)
    if before_start is not None:
        before_start(racks)
    watcher = PlanWatcher(etcd, "job1")
    ctl = start_controller(etcd_server.endpoints, **controller_kw)
    try:
        yield racks, watcher, ctl
    finally:
        ctl.stop()
        watcher.close()


def fail_gpu(etcd: Etcd, node: str, gpus: int, failed: set[int], seq: int = 1) -> float:
    """Write the node's health with ``failed`` GPUs marked GPU_FAILED; returns when."""
    at = time.monotonic()
    etcd.put(keys.health(node), codec.encode(synthetic.failed_health(node, gpus, failed, seq)))
    return at


# ---- real tpflex-controller processes ----

import os  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from tests.support.ports import free_ports  # noqa: E402

CONTROLLER_BIN = str(Path(sys.executable).parent / "tpflex-controller")


class ControllerProc:
    """A real ``tpflex-controller`` process on free loopback ports."""

    def __init__(self, endpoints: list[str], name: str, log_dir: Path, ttl: int = 2,
                 extra: list[str] = (), env: dict[str, str] | None = None, prefix: list[str] = ()) -> None:
        """``prefix``: a command that runs the controller (e.g. tests/support/seccomp_deny.py)."""
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self._command = [*prefix, CONTROLLER_BIN, "--name", name, "--etcd", ",".join(endpoints),
                         "--lease-ttl-s", str(ttl)]
        self._extra = list(extra)
        if "--job-credentials" not in self._extra and "--config" not in self._extra:
            # these tests' trainers carry no job credential (tests/security/test_job_credentials.py
            # tests the required mode against real processes)
            self._extra += ["--job-credentials", "off"]
        self._env = {k: v for k, v in os.environ.items() if not k.startswith("TPFLEX_")}
        self._env.update(env or {})
        self._launch()

    def _launch(self) -> None:
        self.rest_port, self.trainer_port = free_ports(2)
        self._log_from = self.log_path.stat().st_size
        self.proc = subprocess.Popen(
            [*self._command, "--rest-listen", f"127.0.0.1:{self.rest_port}",
             "--trainer-listen", f"127.0.0.1:{self.trainer_port}", *self._extra],
            stdout=self._log, stderr=subprocess.STDOUT, env=self._env)

    def _lost_a_port(self) -> bool:
        """It exited because another process bound one of its ports between their pick
        (free_ports) and its bind: the pick-then-bind race, not a controller fault."""
        with open(self.log_path, "rb") as f:
            f.seek(self._log_from)
            return b"cannot bind" in f.read()

    @property
    def rest_url(self) -> str:
        return f"http://127.0.0.1:{self.rest_port}"

    def wait_http(self, timeout: float = 30.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        relaunches = 2
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and relaunches and self._lost_a_port():
                relaunches -= 1  # on two other ports
                self._launch()
                continue
            assert self.proc.poll() is None, f"controller {self.name} exited: {self.log()}"
            try:
                if httpx.get(self.rest_url + "/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"controller {self.name} did not serve within {timeout}s: {self.log()}")

    def metric(self, name: str) -> float | None:
        import httpx

        for line in httpx.get(self.rest_url + "/metrics", timeout=5).text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return None

    def metric_sum(self, name: str) -> float:
        import httpx

        lines = httpx.get(self.rest_url + "/metrics", timeout=5).text.splitlines()
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith(name + "{"))

    def rest_pids(self) -> list[int]:
        """The pids of the REST child processes this controller started, oldest first."""
        return [int(p) for p in re.findall(r"rest process started pid=(\d+)", self.log_path.read_text())]

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-3000:]
        except OSError:
            return "<no log>"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired as exc:
                state = _signal_state(self.proc.pid)  # before the kill: why SIGTERM did not stop it
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"controller {self.name} did not exit {timeout} s after SIGTERM; "
                                     f"{state}; log tail:\n{self.log()}") from exc
        self._log.close()
        return self.proc.returncode


def _signal_state(pid: int) -> str:
    """A process's signal masks (blocked, ignored, caught, pending) and what each of its
    threads waits in (/proc), for a stop that did not happen."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        masks = " ".join(ln.replace("\t", "") for ln in status if ln.startswith(("Sig", "ShdPnd")))
        threads = []
        for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
            comm = (task / "comm").read_text().strip()
            wchan = (task / "wchan").read_text().strip()
            threads.append(f"{task.name}:{comm}:{wchan}")
        return f"{masks}; threads {' '.join(threads)}"
    except OSError as exc:
        return f"/proc unreadable: {exc}"


def leader_id(etcd: Etcd) -> str | None:
    kv = etcd.get(keys.LEADER)
    return codec.decode(types_pb2.LeaderRecord, kv.value).id if kv else None


def wait_leader(etcd: Etcd, other_than: str | None = None, timeout: float = 15.0) -> tuple[str, float]:
    """Poll etcd until a leader (other than ``other_than``) holds the key; (id, when)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lid = leader_id(etcd)
        if lid and lid != other_than:
            return lid, time.monotonic()
        time.sleep(0.02)
    raise TimeoutError(f"no new leader within {timeout}s")


def eventually(check, timeout: float = 10.0, interval: float = 0.02):
    """Poll ``check()`` until it returns a truthy value (for state another thread updates
    right after an etcd write the test can observe, e.g. metrics); returns that value."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            assert got, f"condition not met within {timeout}s"
            return got
        time.sleep(interval)
