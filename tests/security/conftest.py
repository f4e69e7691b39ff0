"""Fixtures for the security tests: development certificates from deploy/certs (a trusted
set and an untrusted one from another CA) and a secured controller + agent + etcd stack."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.tools import make_certs
from tests.security.stack import Stack, start_stack


def _certs(tmp_path_factory, name: str) -> Path:
    out = tmp_path_factory.mktemp(name) / "certs"
    result = make_certs(out)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> Path:
    return _certs(tmp_path_factory, "certs")


@pytest.fixture(scope="session")
def rogue_certs(tmp_path_factory) -> Path:
    """Certificates with the same names, signed by a CA nobody trusts."""
    return _certs(tmp_path_factory, "rogue")


@pytest.fixture(scope="module")
def stack(certs, tmp_path_factory) -> Stack:
    s = start_stack(certs, tmp_path_factory.mktemp("stack"))
    try:
        yield s
    finally:
        s.stop()
