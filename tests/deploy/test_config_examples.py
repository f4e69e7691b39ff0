"""The example configuration and environment files are consistent with each other and
are accepted by the real services' loaders (`--print-config`, the console scripts as
processes); the refusals of broken copies come from the same entry points called in this
process (tests/support/entry.py; the refusal as a process, exit 2 without a traceback, is
tests/security/test_service_config.py's)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.deploy.tools import DEPLOY, stage_etc_tpflex
from tests.support.entry import call_service

CONFIG = DEPLOY / "config"
ENV = DEPLOY / "env"
BIN = Path(sys.executable).parent
SERVICES = ["controller", "agent"]
ENV_LINE = re.compile(r"^#?(TPFLEX_([A-Z_]+?)__([A-Z_]+))=(.*)$")


def _toml(service: str) -> dict:
    return tomllib.loads((CONFIG / f"{service}.toml").read_text())


def _env_examples(service: str) -> dict[str, str]:
    """Every TPFLEX_* assignment in the env file, commented-out examples included."""
    found = {}
    for line in (ENV / f"{service}.env").read_text().splitlines():
        match = ENV_LINE.match(line.strip())
        if match:
            found[match.group(1)] = match.group(4)
    return found


def _print_config(service: str, staged: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    script = BIN / f"tpflex-{service}"
    if not script.exists():
        pytest.skip(f"{script} not installed (make install)")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TPFLEX_")}
    return subprocess.run(
        [str(script), "--config", str(staged / f"{service}.toml"), "--print-config"],
        capture_output=True, text=True, env={**clean, **env}, timeout=30,
    )


def test_timeout_hierarchy_holds_and_lease_ttls_agree():
    timeouts = _toml("controller")["timeouts"]
    assert (
        timeouts["agent_lease_ttl_s"] < timeouts["reaction_bound_s"]
        < timeouts["trainer_collective_timeout_s"]
    )
    assert _toml("agent")["etcd"]["lease_ttl_s"] == timeouts["agent_lease_ttl_s"]


@pytest.mark.parametrize("service", SERVICES)
def test_secrets_only_come_from_files_under_etc_tpflex(service):
    for section, values in _toml(service).items():
        for key, value in values.items():
            if re.search(r"password|token|secret|key", key):
                assert key.endswith("_file"), f"{section}.{key} must name a file"
            if key.endswith("_file"):
                assert value.startswith("/etc/tpflex/"), f"{section}.{key}={value}"


@pytest.mark.parametrize("service", SERVICES)
def test_env_examples_name_existing_keys(service):
    config = _toml(service)
    examples = _env_examples(service)
    assert examples, f"{service}.env has no examples"
    for name in examples:
        match = ENV_LINE.match(f"{name}=")
        section, key = match.group(2).lower(), match.group(3).lower()
        assert key in config.get(section, {}), f"{name} names no key of {service}.toml"


@pytest.mark.parametrize("service", SERVICES)
def test_the_service_accepts_the_example_config_and_env_overrides_win(service, tmp_path, dev_certs):
    staged = stage_etc_tpflex(tmp_path / "etc-tpflex", dev_certs)
    examples = _env_examples(service)
    result = _print_config(service, staged, examples)
    assert result.returncode == 0, result.stderr
    effective = json.loads(result.stdout)
    file_config = _toml(service)
    for name, raw in examples.items():
        match = ENV_LINE.match(f"{name}=")
        section, key = match.group(2).lower(), match.group(3).lower()
        expected = json.loads(raw) if raw[:1] == "[" else raw
        if key == "endpoints":
            expected = [re.sub(r"^https?://", "", e) for e in expected]
        assert str(effective[section][key]).lower() == str(expected).lower(), name
    assert effective["etcd"]["lease_ttl_s"] == file_config["etcd"]["lease_ttl_s"]


@pytest.mark.parametrize("service", SERVICES)
def test_an_unknown_key_in_the_example_config_is_refused_by_name(service, tmp_path, dev_certs):
    staged = stage_etc_tpflex(tmp_path / "etc-tpflex", dev_certs)
    path = staged / f"{service}.toml"
    path.write_text(path.read_text().replace("[etcd]\n", "[etcd]\nlease_ttl = 5\n", 1))
    result = call_service(service, "--config", str(staged / f"{service}.toml"), "--print-config")
    assert result.returncode != 0
    assert "etcd.lease_ttl" in result.stderr and str(path) in result.stderr
    assert "Traceback" not in result.stderr


def test_the_controller_refuses_a_broken_timeout_hierarchy(tmp_path, dev_certs):
    staged = stage_etc_tpflex(tmp_path / "etc-tpflex", dev_certs)
    result = call_service("controller", "--config", str(staged / "controller.toml"), "--print-config",
                          env={"TPFLEX_TIMEOUTS__REACTION_BOUND_S": "3"})
    assert result.returncode != 0
    assert "reaction_bound_s" in result.stderr and "Traceback" not in result.stderr
