"""What per-job trainer credentials cost a trainer-plane call (issue 40).

A real etcd and the controller's trainer gRPC server in this process; the same
rendezvous ``Set`` (the call group formation makes O(N) of) over a real channel, first
with ``[trainer] job_credentials = off`` (the baseline), then with a credential checked
on every call (``JobAuth``: a positive check cached 1 s, so one etcd read per credential
per second). Prints one JSON line: ``calls``, ``off_wall_ms_per_call``,
``on_wall_ms_per_call``, ``off_cpu_ms_per_call``, ``on_cpu_ms_per_call`` (this process's
CPU: client and server), and ``on_vs_off_cpu_ratio``. ``--quick``: 200 calls instead of
3,000 (the same keys).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpflex_controller.credentials import Credentials, JobAuth  # noqa: E402
from tpflex_controller.trainer_service import create_grpc_server  # noqa: E402
from tpflex_proto import codec, keys, rendezvous_pb2, rendezvous_pb2_grpc, types_pb2  # noqa: E402
from tpflex_proto.etcd import Etcd  # noqa: E402

from tests.support.etcd_server import EtcdCluster  # noqa: E402


def measure(etcd: Etcd, calls: int, auth: JobAuth | None, token: str) -> tuple[float, float]:
    """(wall ms, CPU ms) per Set call."""
    server, port = create_grpc_server(etcd, bind="127.0.0.1:0", max_workers=8, job_auth=auth)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = rendezvous_pb2_grpc.RendezvousStub(channel)
        metadata = (("authorization", f"Bearer {token}"),) if auth is not None else ()
        for i in range(50):  # warm: channel, caches
            stub.Set(rendezvous_pb2.StoreSetRequest(job="bench", key=f"w{i}", value=b"x"), metadata=metadata)
        c0, t0 = time.process_time(), time.perf_counter()
        for i in range(calls):
            stub.Set(rendezvous_pb2.StoreSetRequest(job="bench", key=f"k{i % 64}", value=b"x"),
                     metadata=metadata, timeout=10)
        return (time.perf_counter() - t0) / calls * 1e3, (time.process_time() - c0) / calls * 1e3
    finally:
        channel.close()
        server.stop(0).wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="200 calls instead of 3,000 (the same keys)")
    calls = 200 if ap.parse_args(argv).quick else 3000
    with tempfile.TemporaryDirectory(prefix="tpflex-bench-auth-") as tmp:
        cluster = EtcdCluster(1, Path(tmp) / "etcd")
        cluster.start()
        etcd = Etcd(cluster.endpoints, timeout=2.0)
        try:
            spec = types_pb2.JobSpec(name="bench", base_tp=1, min_tp=1, policy="ntp-pw", local_batch=1,
                                     global_batch=1)
            etcd.put(keys.job_spec("bench"), codec.encode(spec))
            token = Credentials(etcd).issue("bench", "node-0", "bench")
            off_wall, off_cpu = measure(etcd, calls, None, token)
            on_wall, on_cpu = measure(etcd, calls, JobAuth(Credentials(etcd)), token)
        finally:
            etcd.close()
            cluster.stop()
    print(json.dumps({"calls": calls, "off_wall_ms_per_call": round(off_wall, 3),
                      "on_wall_ms_per_call": round(on_wall, 3), "off_cpu_ms_per_call": round(off_cpu, 3),
                      "on_cpu_ms_per_call": round(on_cpu, 3),
                      "on_vs_off_cpu_ratio": round(on_cpu / off_cpu, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
