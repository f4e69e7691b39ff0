"""Test harness for the REST API: a real etcd, the app served by a real uvicorn on a free
port (in a thread), seeded cluster state written through the Store."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn
from prometheus_client import CollectorRegistry, Gauge
from tpflex_controller import convert
from tpflex_controller.api import ApiDeps, create_app, load_tokens
from tpflex_controller.store import Store
from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.etcd import Etcd

from tests.support.etcd_server import EtcdCluster

ADMIN = "admin-3f9c1e7d2b"
READER = "reader-8a4d6b2c1f"
NOW = 1_790_000_000.0
JOB = "llama"
RACKS = ("rack-a", "rack-b")
NODES_PER_RACK = 2
GPUS_PER_NODE = 4
T = NODES_PER_RACK * GPUS_PER_NODE


def node_name(rack: str, i: int) -> str:
    return f"{rack}-n{i}"


class ServedApp:
    """uvicorn serving ``app`` on a pre-bound loopback socket, in a thread."""

    def __init__(self, app) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self, timeout: float = 15.0) -> ServedApp:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


def write_token_file(directory: Path) -> Path:
    """Writes ``admin.tokens`` and ``readonly.tokens`` (one token per line) into
    ``directory`` and returns the directory, the argument ``make_deps`` takes."""
    (directory / "admin.tokens").write_text(f"{ADMIN}\n")
    (directory / "readonly.tokens").write_text(f"# readers\n{READER}\n")
    return directory


def make_deps(etcd: Etcd, token_dir: Path, *, protect_reads: bool = False) -> ApiDeps:
    registry = CollectorRegistry()
    Gauge("tpflex_test_marker", "marker gauge for the /metrics test", registry=registry).set(7)
    tokens = load_tokens(
        token_dir / "admin.tokens", token_dir / "readonly.tokens", protect_reads=protect_reads
    )
    return ApiDeps(
        store=Store(etcd), etcd=etcd, tokens=tokens, registry=registry, clock=lambda: NOW,
    )


@dataclass
class Served:
    etcd: Etcd
    store: Store
    app_server: ServedApp
    http: httpx.Client

    @property
    def url(self) -> str:
        return self.app_server.url

    def close(self) -> None:
        self.http.close()
        self.app_server.stop()


def serve(etcd: Etcd, token_dir: Path, *, protect_reads: bool = False) -> Served:
    app_server = ServedApp(create_app(make_deps(etcd, token_dir, protect_reads=protect_reads))).start()
    http = httpx.Client(base_url=app_server.url, timeout=10.0)
    return Served(etcd, Store(etcd), app_server, http)


@contextmanager
def served_api(base: Path, *, protect_reads: bool = False, write_tokens: bool = True) -> Iterator[Served]:
    """A fresh one-member etcd under ``base`` and the API served over it (token files in
    ``base``: this harness's, or with ``write_tokens=False`` the caller's); all of it
    stopped on exit."""
    cluster = EtcdCluster(1, base / "etcd").start()
    etcd = Etcd(cluster.endpoints, timeout=2.0)
    try:
        served = serve(etcd, write_token_file(base) if write_tokens else base, protect_reads=protect_reads)
        try:
            yield served
        finally:
            served.close()
    finally:
        etcd.close()
        cluster.stop()


def admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}"}


def reader() -> dict[str, str]:
    return {"Authorization": f"Bearer {READER}"}


# ---- seeded state ----


def seed(store: Store, *, registered_missing: str | None = None) -> types_pb2.Plan:
    """Two racks of 2 nodes x 4 GPUs (T=8), every node registered except
    ``registered_missing``, all GPUs healthy, a 2-replica job, leader, plan generation 1
    made by the planner, two acks, three events."""
    etcd = store.etcd
    etcd.delete_prefix(keys.PREFIX)
    for rack in RACKS:
        nodes = [node_name(rack, i) for i in range(NODES_PER_RACK)]
        store.put_rack(types_pb2.Rack(
            name=rack, domain_size=T, power_budget_w=T * 1300.0, gpu_tdp_w=1000.0,
            gpu_min_w=200.0, gpu_max_w=1300.0, nodes=nodes, gpus_per_node=GPUS_PER_NODE,
        ))
        for n in nodes:
            if n != registered_missing:
                register(store, rack, n)
            put_health(store, n, {})
    store.put_job(job_spec())
    etcd.put(keys.LEADER, codec.encode(types_pb2.LeaderRecord(id="ctl-1", address="10.0.0.1:7070", since=NOW)))
    plan = make_plan(store, generation=1)
    etcd.put(keys.job_plan(JOB), codec.encode(plan))
    etcd.put(keys.job_plan_history(JOB, 1), codec.encode(plan))
    for rank in (0, 1):
        etcd.put(keys.job_ack(JOB, rank), codec.encode(types_pb2.Ack(job=JOB, rank=rank, generation=1, acked_at=NOW)))
    for seq in (1, 2, 3):
        ev = types_pb2.Event(seq=seq, at=NOW + seq, kind="plan", job=JOB, generation=1, cause=f"cause-{seq}")
        etcd.put(keys.event(seq), codec.encode(ev))
    return plan


def register(store: Store, rack: str, node: str) -> None:
    gpus = [
        types_pb2.GpuDevice(index=i, uuid=f"GPU-{node}-{i}", name="sim-B200", power_limit_w=1000.0,
                            default_limit_w=1000.0, min_limit_w=200.0, max_limit_w=1300.0)
        for i in range(GPUS_PER_NODE)
    ]
    reg = types_pb2.Node(name=node, rack=rack, agent_address=f"{node}:7000", gpus=gpus, backend="sim",
                         registered_at=NOW)
    store.etcd.put(keys.node(node), codec.encode(reg))


def put_health(store: Store, node: str, states: dict[int, tuple[int, str]]) -> None:
    """Health of one node: ``states`` maps index -> (GpuState, reason); others healthy."""
    gpus = []
    for i in range(GPUS_PER_NODE):
        state, reason = states.get(i, (types_pb2.GPU_HEALTHY, ""))
        gpus.append(types_pb2.GpuHealth(index=i, state=state, reason=reason, temperature_c=55.0,
                                        power_draw_w=700.0, power_limit_w=1000.0, relative_speed=1.0))
    store.etcd.put(keys.health(node), codec.encode(types_pb2.NodeHealth(node=node, gpus=gpus, updated_at=NOW)))


def job_spec(name: str = JOB, units: dict[str, int] | None = None) -> types_pb2.JobSpec:
    units = units or {"heads": 32, "kv_groups": 8, "ffn": 64}
    return types_pb2.JobSpec(
        name=name, base_tp=T, min_tp=4, policy="ntp-pw", global_batch=64, local_batch=32,
        replicas=[types_pb2.ReplicaSpec(stages=[types_pb2.StageSpec(rack=r)]) for r in RACKS],
        units=[types_pb2.UnitFamily(name=k, count=v, bytes_per_unit=1 << 20) for k, v in units.items()],
    )


def make_plan(store: Store, generation: int) -> types_pb2.Plan:
    from tpflex_controller.planner.planner import plan

    snap = store.snapshot()
    racks = {n: convert.rack_info(r) for n, r in snap.racks.items()}
    result = plan(convert.cluster_state(snap, racks), convert.job_spec(snap.jobs[JOB], racks), now=NOW)
    return convert.plan_to_proto(result, generation, cause="initial", now=NOW)
