"""tpflexctl is its own distribution (issue 36): tpflex-cli (cli/) needs httpx, PyYAML and
tpflex-proto without extras, and nothing of fastapi, uvicorn, grpcio, protobuf or etcd.

Two checks: the declared dependencies, followed over the local packages (tpflex-proto and
the extras a requirement names); and the installed CLI run in a process where importing
fastapi, uvicorn, grpc, google.protobuf, pyetcd, torch or the services' packages raises
ImportError: ``--help`` and real commands against a port nobody listens on still give
their exit codes and messages, and none of those modules is even asked for."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from tpflex_controller.devtools.ports import free_port

REPO = Path(__file__).resolve().parents[2]
LOCAL = {"tpflex-proto": "proto", "tpflex-controller": "controller", "tpflex-agent": "agent",
         "tpflex-trainer": "trainer_hooks", "tpflex-cli": "cli"}
FORBIDDEN_DISTS = {"fastapi", "uvicorn", "grpcio", "protobuf", "etcd-sdk-python"}
BLOCKED = ("fastapi", "uvicorn", "grpc", "google.protobuf", "pyetcd", "torch",
           "tpflex_controller", "tpflex_agent", "tpflex_trainer")


def _requires(dist: str, extras: frozenset[str] = frozenset()) -> set[str]:
    """The external distributions ``dist`` (a local package) needs, with ``extras``:
    base dependencies and those of the extras, local packages followed transitively."""
    seen: set[tuple[str, frozenset[str]]] = set()
    out: set[str] = set()

    def walk(name: str, wanted: frozenset[str]) -> None:
        if (name, wanted) in seen:
            return
        seen.add((name, wanted))
        project = tomllib.loads((REPO / LOCAL[name] / "pyproject.toml").read_text())["project"]
        optional = project.get("optional-dependencies", {})
        lines = list(project.get("dependencies", []))
        for extra in wanted:
            lines += optional[extra]  # KeyError: a requirement names an extra that does not exist
        for line in lines:
            req = Requirement(line)
            req_name = canonicalize_name(req.name)
            if req_name in LOCAL:
                walk(req_name, frozenset(req.extras))
            else:
                out.add(req_name)

    walk(dist, extras)
    return out


def test_cli_and_proto_base_dependencies_have_no_server_stack():
    cli = _requires("tpflex-cli")
    assert cli & FORBIDDEN_DISTS == set(), cli
    assert {"httpx", "pyyaml"} <= cli, cli
    proto = _requires("tpflex-proto")
    assert proto & FORBIDDEN_DISTS == set(), proto
    cli_project = tomllib.loads((REPO / "cli" / "pyproject.toml").read_text())["project"]
    assert cli_project["scripts"]["tpflexctl"] == "tpflex_cli.main:main"
    controller_scripts = tomllib.loads((REPO / "controller" / "pyproject.toml").read_text())["project"]["scripts"]
    assert "tpflexctl" not in controller_scripts  # one package owns the script


def test_the_walk_finds_the_server_stack_where_it_is():
    """The same walk over the services finds what the CLI must not have: it can fail."""
    assert {"grpcio", "protobuf"} <= _requires("tpflex-proto", frozenset({"rpc"}))
    assert FORBIDDEN_DISTS <= _requires("tpflex-controller")
    assert {"grpcio", "protobuf", "etcd-sdk-python"} <= _requires("tpflex-agent")


# the CLI's entry in a process that cannot import the server stack; every attempt is
# recorded and printed to stderr at exit ("blocked: NAME")
_RUNNER = textwrap.dedent("""
    import atexit, importlib.abc, sys

    BLOCKED = {blocked!r}
    asked = []

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                asked.append(name)
                raise ImportError(f"blocked by the test: {{name}}", name=name)
            return None

    sys.meta_path.insert(0, Block())
    atexit.register(lambda: [print(f"blocked: {{n}}", file=sys.stderr) for n in asked])
    from tpflex_cli.main import main
    sys.argv[0] = "tpflexctl"
    sys.exit(main(sys.argv[1:]))
""")


def tpflexctl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    code = _RUNNER.format(blocked=BLOCKED)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd, check=False)


def _blocked(p: subprocess.CompletedProcess) -> list[str]:
    return [ln.split(": ", 1)[1] for ln in p.stderr.splitlines() if ln.startswith("blocked: ")]


def test_help_runs_without_the_server_stack(tmp_path):
    p = tpflexctl("--help", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: tpflexctl") and "racks" in p.stdout and "job-spec" in p.stdout
    assert "Traceback" not in p.stderr and _blocked(p) == [], p.stderr


@pytest.mark.parametrize("command", [["status"], ["racks", "apply", "-f", "inventory.yaml"]])
def test_a_command_against_no_controller_exits_1_with_the_reason(tmp_path, command):
    """``status`` (httpx) and ``racks apply -f`` (PyYAML reads the file first) against a
    port nobody listens on: one line, exit 1, and no module of the server stack asked for."""
    (tmp_path / "inventory.yaml").write_text(
        "racks:\n  - {name: rack-a, domain_size: 8, power_budget_w: 10400, gpu_tdp_w: 1000,\n"
        "     gpu_min_w: 200, gpu_max_w: 1300, gpus_per_node: 4, nodes: [rack-a-n0, rack-a-n1]}\n")
    url = f"http://127.0.0.1:{free_port()}"
    p = tpflexctl("--url", url, "--timeout", "5", *command, cwd=tmp_path)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert p.stdout == ""
    assert p.stderr.startswith(f"tpflexctl: error: cannot reach the tpflex controller at {url}: "), p.stderr
    assert "Traceback" not in p.stderr and _blocked(p) == [], p.stderr


def test_job_spec_without_the_trainer_says_what_it_needs(tmp_path):
    """job-spec builds protobuf messages and derives units with the trainer's adapter: with
    neither importable it exits 2 and names tpflex-trainer, no traceback."""
    p = tpflexctl("job-spec", "--model", str(tmp_path), "--name", "j", "--nodes", "n0", cwd=tmp_path)
    assert p.returncode == 2 and p.stdout == "", (p.stdout, p.stderr)
    assert p.stderr.startswith("tpflexctl job-spec: error: --model: job-spec needs tpflex-trainer"), p.stderr
    assert "Traceback" not in p.stderr
    assert _blocked(p) == ["google.protobuf"], p.stderr  # asked for only where a spec is built
