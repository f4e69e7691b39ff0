"""Fixtures for the deploy artifact tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.tools import make_certs


@pytest.fixture(scope="session")
def dev_certs(tmp_path_factory) -> Path:
    """A directory with the development CA and certificates (made once per session)."""
    out = tmp_path_factory.mktemp("certs") / "certs"
    result = make_certs(out)
    assert result.returncode == 0, result.stderr
    return out
