"""The fleet the hostile-input tests share: a real controller and simulated agents on the
suite's etcd server, closed after each test (test_hostile_fuzz and test_faults keep
their own, differently shaped fleets)."""

from __future__ import annotations

import pytest

from tests.reliability.fleet import Fleet


@pytest.fixture
def fleet(etcd_server, tmp_path):
    f = Fleet(etcd_server.endpoints, tmp_path, agent_ttl=10)
    try:
        yield f
    finally:
        f.close()
