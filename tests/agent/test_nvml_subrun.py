"""Runs the backend conformance suite against the NVML backend over the fake
libnvidia-ml.so.1, in a subprocess whose LD_LIBRARY_PATH points at it from its start."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.agent import test_backend_conformance as suite
from tests.agent.support import FAKE_NVML_DIR, ROOT, build_fake_nvml


def test_nvml_backend_passes_the_conformance_suite_on_the_fake_library():
    build_fake_nvml()
    expected = len([n for n in dir(suite) if n.startswith("test_")])
    env = {**os.environ, "LD_LIBRARY_PATH": str(FAKE_NVML_DIR), "TPFLEX_FAKE_NVML_SUBRUN": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", "tests/pytest.ini", "-v", "-p", "no:cacheprovider",
         "tests/agent/test_backend_conformance.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=100,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = re.findall(r"::(test_\w+)\[nvml\] PASSED", proc.stdout)
    assert len(passed) == expected, proc.stdout[-4000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert "skipped" not in summary and "failed" not in summary, summary
