"""``tpflexctl`` (tpflex_cli, cli/) against a live controller API: the REST API tests'
fixtures (tests/controller/conftest.py, ``api_harness``), shared rather than copied."""

from tests.controller.conftest import api, served  # noqa: F401  (pytest fixtures)
