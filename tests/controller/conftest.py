"""Fixtures shared by the REST API and ``tpflexctl`` tests (see ``api_harness``)."""

from __future__ import annotations

import pytest

from tests.controller import api_harness as h


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The API (reads open) over a fresh one-member etcd, shared by one test module."""
    with h.served_api(tmp_path_factory.mktemp("api")) as served:
        yield served


@pytest.fixture
def api(served):
    """``served`` with the seeded cluster state written afresh; ``api.plan`` is its plan."""
    served.plan = h.seed(served.store)
    return served
