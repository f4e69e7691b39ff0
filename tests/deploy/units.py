"""Reading systemd unit files and staging them for ``systemd-analyze`` in a temp dir."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

EXEC_PREFIXES = "-@:+!"


def unit_settings(text: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values in order (systemd keys may repeat; '' resets a list)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        header = re.fullmatch(r"\[(\w+)\]", line)
        if header:
            current = sections.setdefault(header.group(1), {})
            continue
        assert current is not None, f"setting outside a section: {raw!r}"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def exec_binary(exec_start: str) -> str:
    """The program path of an ExecStart= value (without systemd's prefix characters)."""
    return exec_start.lstrip(EXEC_PREFIXES).split()[0]


def stage_with_stub_binaries(unit: Path, dest: Path) -> Path:
    """Copy ``unit`` into ``dest`` with every ExecStart program replaced by a stub.

    ``systemd-analyze verify`` refuses a unit whose ExecStart program does not exist, and
    /opt/tpflex/venv is not installed on a development machine. The stub is an executable
    created here; nothing else in the unit changes, so every other setting is verified
    as written.
    """
    bin_dir = dest / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for line in unit.read_text().splitlines():
        if line.startswith("ExecStart="):
            program = exec_binary(line.partition("=")[2])
            stub = bin_dir / Path(program).name
            stub.write_text("#!/bin/sh\nexit 0\n")
            stub.chmod(0o755)
            line = line.replace(program, str(stub), 1)
        lines.append(line)
    staged = dest / unit.name
    staged.write_text("\n".join(lines) + "\n")
    return staged


def stage_dropin(base_unit: Path, dropin_dir: Path, dest: Path) -> Path:
    """Copy a packaged unit and our drop-in directory side by side into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    staged = dest / base_unit.name
    shutil.copy(base_unit, staged)
    shutil.copytree(dropin_dir, dest / dropin_dir.name)
    return staged
