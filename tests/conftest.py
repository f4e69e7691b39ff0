"""Shared fixtures: a real etcd (single member and 3-member cluster) on loopback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

from tests.support.etcd_server import EtcdCluster

# Property tests draw the same examples on every run unless TPFLEX_HYPOTHESIS=explore: a
# CI run must not pass or fail on the luck of the draw. Explore locally to find new
# counterexamples, then pin each one down as a plain test. No per-example deadline: the
# suite shares 2 cores, and a property test asserts behaviour, never time.
settings.register_profile("ci", derandomize=True, database=None, deadline=None)
settings.register_profile("explore", database=None, deadline=None)
settings.load_profile(os.environ.get("TPFLEX_HYPOTHESIS", "ci"))


class _NextEtcd:
    """Fresh single-member etcds, one per test, each started while the test before runs:
    ``take`` hands out the one started last time (waiting until it is healthy) and starts
    the next. Isolation is the same as starting one in the test: no other test ever
    reaches the etcd it gets, and it stops after the test (killed or restarted members
    included); only its start-up (~0.3-0.5 s) overlaps the previous test."""

    def __init__(self, base: Path) -> None:
        self.base, self.count, self.next = base, 0, None

    def _launch(self) -> EtcdCluster:
        cluster = EtcdCluster(1, self.base / f"etcd-{self.count}")
        self.count += 1
        for m in cluster.members:
            m.start(cluster.initial_cluster)
        return cluster

    def take(self) -> EtcdCluster:
        cluster, self.next = self.next, None
        if cluster is not None:
            try:
                cluster.wait_healthy()
            except Exception:  # noqa: BLE001 -- it died waiting: start one now, as without it
                cluster.stop()
                cluster = None
        if cluster is None:
            cluster = self._launch()
            try:
                cluster.wait_healthy()
            except BaseException:
                cluster.stop()
                raise
        self.next = self._launch()
        return cluster

    def close(self) -> None:
        if self.next is not None:
            self.next.stop()
            self.next = None


@pytest.fixture(scope="session")
def _next_etcd(tmp_path_factory):
    etcds = _NextEtcd(tmp_path_factory.mktemp("etcd-per-test"))
    try:
        yield etcds
    finally:
        etcds.close()


@pytest.fixture
def etcd_server(_next_etcd):
    """A fresh single-member etcd for one test; yields the EtcdCluster (``.endpoints``)."""
    cluster = _next_etcd.take()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def etcd_cluster3(tmp_path):
    """A fresh 3-member etcd cluster for one test."""
    cluster = EtcdCluster(3, tmp_path / "etcd3")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def etcd(etcd_server):
    """A connected tpflex Etcd client on a fresh single-member etcd."""
    from tpflex_proto.etcd import Etcd

    client = Etcd(etcd_server.endpoints, timeout=2.0)
    try:
        yield client
    finally:
        client.close()
