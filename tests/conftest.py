"""Shared fixtures: a real etcd (single member and 3-member cluster) on loopback."""

from __future__ import annotations

import os

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


@pytest.fixture
def etcd_server(tmp_path):
    """A fresh single-member etcd for one test; yields the EtcdCluster (``.endpoints``)."""
    cluster = EtcdCluster(1, tmp_path / "etcd")
    cluster.start()
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
