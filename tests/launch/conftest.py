"""Fixtures for the launcher and rendezvous tests: a real etcd and a real controller
gRPC server (Trainer + Rendezvous) on loopback, shared by one test module."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from tpflex_controller.rendezvous import (
    RendezvousLimits,
    RendezvousServicer,
    add_rendezvous,
)
from tpflex_controller.trainer_service import create_grpc_server
from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.etcd import Etcd

from tests.support.etcd_server import EtcdCluster

_names = itertools.count()


@dataclass
class Served:
    etcd: Etcd
    endpoint: str
    cluster: EtcdCluster
    rendezvous: RendezvousServicer

    def new_job(self, prefix: str = "job") -> str:
        """A registered job of its own (the store serves registered jobs only)."""
        name = f"{prefix}-{next(_names)}"
        register_job(self.etcd, name)
        return name


def register_job(etcd: Etcd, name: str) -> None:
    spec = types_pb2.JobSpec(name=name, base_tp=1, min_tp=1, policy="ntp-pw", local_batch=1, global_batch=1)
    etcd.put(keys.job_spec(name), codec.encode(spec))


def serve(etcd: Etcd, limits: RendezvousLimits = RendezvousLimits(), max_workers: int = 16):
    """A controller trainer gRPC server (Trainer + Rendezvous); (server, endpoint, servicer)."""
    server, port = create_grpc_server(etcd, bind="127.0.0.1:0", max_workers=max_workers, rendezvous=None)
    servicer = add_rendezvous(server, etcd, limits)
    server.start()
    return server, f"127.0.0.1:{port}", servicer


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cluster = EtcdCluster(1, tmp_path_factory.mktemp("etcd") / "etcd")
    cluster.start()
    etcd = Etcd(cluster.endpoints, timeout=2.0)
    server, endpoint, servicer = serve(etcd)
    try:
        yield Served(etcd, endpoint, cluster, servicer)
    finally:
        server.stop(0).wait()
        etcd.close()
        cluster.stop()
