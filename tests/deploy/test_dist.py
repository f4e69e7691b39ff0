"""`make dist` builds one wheel per component, and every module in a wheel comes from the
source tree (no stale files from an earlier build)."""

from __future__ import annotations

import subprocess
import zipfile

import pytest
from packaging.requirements import Requirement

from tests.deploy.tools import REPO

PACKAGES = {
    "tpflex_proto": "proto",
    "tpflex_controller": "controller",
    "tpflex_agent": "agent",
    "tpflex_trainer": "trainer_hooks",
    "tpflex_cli": "cli",
}


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """One `make dist` for the module's tests (they only read the wheels): (out, result)."""
    out = tmp_path_factory.mktemp("dist") / "dist"
    result = subprocess.run(["make", "-s", "dist", f"DIST={out}"], cwd=REPO, capture_output=True,
                            text=True, timeout=110)
    return out, result


def test_make_dist_builds_a_wheel_per_component(dist):
    out, result = dist
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


def _metadata(wheel) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return z.read(name).decode().splitlines()


def test_wheels_declare_ranges_a_license_and_a_version_from_git(dist):
    """Operators install the wheels beside their own stack (the trainer into an NGC or
    Megatron image with its own torch): dependencies are ranges, exact pins live only in
    constraints.txt; the version comes from git (setuptools-scm), the license is Apache-2.0."""
    out, result = dist
    assert result.returncode == 0, result.stdout + result.stderr
    describe = subprocess.run(["git", "describe", "--tags", "--always"], cwd=REPO, capture_output=True,
                              text=True).stdout.strip()
    versions = set()
    for wheel in sorted(out.glob("*.whl")):
        meta = _metadata(wheel)
        requires = [ln.split(":", 1)[1].strip() for ln in meta if ln.startswith("Requires-Dist:")]
        assert requires, wheel.name
        specs = {r: {s.operator for s in Requirement(r).specifier} for r in requires}
        pinned = [r for r, ops in specs.items() if ops & {"==", "==="}]
        assert pinned == [], f"{wheel.name} pins exact versions: {pinned}"
        unbounded_below = [r for r, ops in specs.items() if not ops & {">=", ">", "~="}]
        assert unbounded_below == [], f"{wheel.name} has no lower bound for: {unbounded_below}"
        assert "License-Expression: Apache-2.0" in meta, wheel.name
        with zipfile.ZipFile(wheel) as z:
            assert any(n.endswith("licenses/LICENSE") for n in z.namelist()), wheel.name
        versions.add(next(ln.split(":", 1)[1].strip() for ln in meta if ln.startswith("Version:")))
    assert len(versions) == 1, versions  # the components are released together
    version = versions.pop()
    assert version not in ("0.0.0", "0+unknown"), version
    if describe.startswith("v") and "-" not in describe:  # on a tag: exactly its version
        assert version == describe[1:].split("-")[0]
    trainer = _metadata(next(out.glob("tpflex_trainer-*.whl")))
    torch = [ln for ln in trainer if ln.startswith("Requires-Dist: torch")]
    assert torch and "2.13.0" not in torch[0], torch  # any recent torch, not the dev pin
    constraints = (REPO / "constraints.txt").read_text()
    assert "torch==2.13.0" in constraints
    with zipfile.ZipFile(next(out.glob("tpflex_controller-*.whl"))) as z:  # the console ships
        static = {n.rsplit("/", 1)[1] for n in z.namelist() if "/api/console/static/" in n}
    assert static == {"index.html", "console.js", "console-map.js", "console-actions.js", "console.css"}


# the wheels a GPU node installs: the agent, the trainer hooks and what they depend on
GPU_NODE_WHEELS = ("tpflex_proto", "tpflex_agent", "tpflex_trainer")
DEV_MODULES = ("devtools/etcd_server.py", "devtools/secure_etcd.py", "devtools/ports.py")


def test_the_development_etcd_launcher_is_not_in_a_gpu_node_wheel(dist):
    """The local etcd launcher, the development certificates and etcd's dev auth set-up
    ship with the controller (control-plane hosts), which the trainer's ``demo`` extra
    requires; a GPU node's wheels carry none of them."""
    out, result = dist
    assert result.returncode == 0, result.stdout + result.stderr
    for package in GPU_NODE_WHEELS:
        with zipfile.ZipFile(next(out.glob(f"{package}-*.whl"))) as z:
            names = z.namelist()
        leaked = [n for n in names if "devtools" in n or n.endswith(("etcd_server.py", "secure_etcd.py"))]
        assert leaked == [], f"{package} ships development tools: {leaked}"
    with zipfile.ZipFile(next(out.glob("tpflex_controller-*.whl"))) as z:
        names = set(z.namelist())
    assert {f"tpflex_controller/{m}" for m in DEV_MODULES} <= names
    demo = [ln for ln in _metadata(next(out.glob("tpflex_trainer-*.whl")))
            if ln.startswith("Requires-Dist:") and 'extra == "demo"' in ln]
    assert any(ln.split(":", 1)[1].strip().startswith("tpflex-controller") for ln in demo), demo
