"""The import contracts of .importlinter (make lint): the tree keeps them, and a
deliberately wrong import breaks them. The second check runs lint-imports over a copy of
the packages with one import planted (the planner importing the store), found first on
PYTHONPATH."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).parent / "lint-imports"
PACKAGES = {"tpflex_proto": "proto", "tpflex_controller": "controller", "tpflex_agent": "agent",
            "tpflex_trainer": "trainer_hooks", "tpflex_cli": "cli"}


def _lint(pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([str(LINT), "--config", str(REPO / ".importlinter"), "--no-cache"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=pythonpath or REPO)


def _copy(dest: Path) -> Path:
    for package, folder in PACKAGES.items():
        shutil.copytree(REPO / folder / package, dest / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def test_the_tree_keeps_its_import_contracts():
    result = _lint()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_a_planner_importing_the_store_breaks_the_contracts(tmp_path):
    tree = _copy(tmp_path / "tree")
    clean = _lint(tree)
    assert clean.returncode == 0, clean.stdout[-3000:]  # the copy alone keeps them
    model = tree / "tpflex_controller" / "planner" / "model.py"
    text = model.read_text()
    model.write_text(text.replace("from __future__ import annotations\n",
                                  "from __future__ import annotations\n\nfrom tpflex_controller import store  # noqa\n", 1))
    broken = _lint(tree)
    assert broken.returncode != 0
    assert "The planner is pure" in broken.stdout and "BROKEN" in broken.stdout
    assert "tpflex_controller.planner.model -> tpflex_controller.store" in broken.stdout
