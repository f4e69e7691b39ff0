"""`make dist` builds one wheel per component, and every module in a wheel comes from the
source tree (no stale files from an earlier build)."""

from __future__ import annotations

import subprocess
import zipfile

from tests.deploy.tools import REPO

PACKAGES = {
    "tpflex_proto": "proto",
    "tpflex_controller": "controller",
    "tpflex_agent": "agent",
    "tpflex_trainer": "trainer_hooks",
}


def test_make_dist_builds_a_wheel_per_component(tmp_path):
    out = tmp_path / "dist"
    result = subprocess.run(["make", "-s", "dist", f"DIST={out}"], cwd=REPO, capture_output=True,
                            text=True, timeout=110)
    assert result.returncode == 0, result.stdout + result.stderr
    wheels = sorted(p.name for p in out.glob("*.whl"))
    assert [w.split("-")[0] for w in wheels] == sorted(PACKAGES), wheels
    for wheel in out.glob("*.whl"):
        package = wheel.name.split("-")[0]
        with zipfile.ZipFile(wheel) as z:
            modules = [n for n in z.namelist() if n.endswith(".py")]
        assert f"{package}/__init__.py" in modules
        for name in modules:
            assert (REPO / PACKAGES[package] / name).is_file(), f"{wheel.name}: {name} is not in the source tree"
        if package == "tpflex_proto":  # generated code and the shared TLS helpers are shipped
            assert {"tpflex_proto/types_pb2.py", "tpflex_proto/agent_pb2_grpc.py", "tpflex_proto/tls.py"} <= set(modules)
