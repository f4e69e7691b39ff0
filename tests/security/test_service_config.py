"""Start-up configuration of the real ``tpflex-controller`` and ``tpflex-agent``: bad
values name the key and where they came from (exit 2, no traceback), ``--print-config``
never prints a secret, the timeout hierarchy and the TLS settings are checked.

The services run as real processes where the process is what is checked (a refusal's
exit status and stderr without a traceback: the unknown-key test for each service; a
controller that stops at start). The other refusals come from the same entry points
called in this process with the same arguments and environment (tests/support/entry.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.entry import call_service

BIN = Path(sys.executable).parent


def _run(service: str, *args: str, env: dict[str, str] | None = None, timeout: float = 60):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TPFLEX_")}
    return subprocess.run([str(BIN / f"tpflex-{service}"), *args], capture_output=True, text=True,
                          env={**clean, **(env or {})}, timeout=timeout)


def _refused(result, *words: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    for w in words:
        assert w in result.stderr, (w, result.stderr)


@pytest.mark.parametrize("service,text,key", [
    ("controller", "[etcd]\nlease_ttl_s = 'five'\n", "etcd.lease_ttl_s"),
    ("controller", "[rest]\nlisten = 8470\n", "rest.listen"),
    ("agent", "[agent]\nsim_gpus = -1\n", "agent.sim_gpus"),
    ("agent", "[grpc]\nlisten = 'nowhere'\n", "grpc.listen"),
])
def test_a_malformed_value_names_the_key_and_the_file(tmp_path, service, text, key):
    path = tmp_path / f"{service}.toml"
    path.write_text(text)
    _refused(call_service(service, "--config", str(path), "--print-config"), key, str(path))


@pytest.mark.parametrize("service", ["controller", "agent"])
def test_unknown_keys_are_refused_from_file_and_environment(tmp_path, service):
    path = tmp_path / f"{service}.toml"
    path.write_text("[etcd]\ntls = true\n")
    _refused(_run(service, "--config", str(path), "--print-config"), "etcd.tls", str(path))
    result = _run(service, "--print-config", env={"TPFLEX_ETCD__PASSWORD": "hunter2"})
    _refused(result, "etcd.password", "TPFLEX_ETCD__PASSWORD")
    assert "hunter2" not in result.stderr + result.stdout


def test_a_value_from_the_environment_is_blamed_on_its_variable(tmp_path):
    path = tmp_path / "controller.toml"
    path.write_text("[etcd]\nlease_ttl_s = 3\n")
    result = call_service("controller", "--config", str(path), "--print-config",
                   env={"TPFLEX_ETCD__DIAL_TIMEOUT_S": "soon"})
    _refused(result, "etcd.dial_timeout_s", "TPFLEX_ETCD__DIAL_TIMEOUT_S")


def _secret_files(tmp_path: Path) -> dict[str, Path]:
    files = {
        "admin": ("admin.tokens", "admin-token-AAAA\n"),
        "reader": ("readonly.tokens", "reader-token-BBBB\n"),
        "password": ("etcd.password", "etcd-password-CCCC\n"),
    }
    out = {}
    for name, (fname, content) in files.items():
        out[name] = tmp_path / fname
        out[name].write_text(content)
    return out


def test_print_config_shows_secret_paths_never_their_contents(tmp_path, certs):
    s = _secret_files(tmp_path)
    ctl = tmp_path / "controller.toml"
    ctl.write_text(f"""
[etcd]
username = "tpflex-controller"
password_file = "{s['password']}"
ca_file = "{certs}/ca.pem"
cert_file = "{certs}/controller.pem"
key_file = "{certs}/controller-key.pem"
[rest]
admin_tokens_file = "{s['admin']}"
readonly_tokens_file = "{s['reader']}"
""")
    result = call_service("controller", "--config", str(ctl), "--print-config")
    assert result.returncode == 0, result.stderr
    effective = json.loads(result.stdout)
    assert effective["rest"]["admin_tokens_file"] == str(s["admin"])
    assert effective["etcd"]["password_file"] == str(s["password"])
    private_key = (certs / "controller-key.pem").read_text().splitlines()[1]
    for secret in ("admin-token-AAAA", "reader-token-BBBB", "etcd-password-CCCC", private_key):
        assert secret not in result.stdout
    agent = tmp_path / "agent.toml"
    agent.write_text(f'[etcd]\nusername = "a"\npassword_file = "{s["password"]}"\n[grpc]\ninsecure = true\n')
    result = call_service("agent", "--config", str(agent), "--print-config")
    assert result.returncode == 0, result.stderr
    assert "etcd-password-CCCC" not in result.stdout and str(s["password"]) in result.stdout


@pytest.mark.parametrize("env,words", [
    ({"TPFLEX_TIMEOUTS__AGENT_LEASE_TTL_S": "20"}, ["agent_lease_ttl_s < reaction_bound_s"]),
    ({"TPFLEX_TIMEOUTS__TRAINER_COLLECTIVE_TIMEOUT_S": "10"},
     ["reaction_bound_s < trainer_collective_timeout_s"]),
    ({"TPFLEX_ETCD__LEASE_TTL_S": "15"}, ["etcd.lease_ttl_s + 1 <= timeouts.reaction_bound_s"]),
    ({"TPFLEX_AGENTS__RPC_TIMEOUT_S": "30"}, ["agents.rpc_timeout_s < timeouts.reaction_bound_s"]),
])
def test_the_timeout_hierarchy_is_checked_at_start(env, words):
    _refused(call_service("controller", "--print-config", env=env), *words)


@pytest.mark.parametrize("service,env,words", [
    ("controller", {"TPFLEX_TRAINER__CLIENT_CA_FILE": "{ca}"}, ["client_ca_file needs tls_cert_file"]),
    ("controller", {"TPFLEX_REST__TLS_CERT_FILE": "{cert}"}, ["tls_cert_file and tls_key_file go together"]),
    ("controller", {"TPFLEX_ETCD__USERNAME": "u"}, ["username needs password_file"]),
    ("agent", {"TPFLEX_GRPC__CLIENT_CA_FILE": "{ca}"}, ["client_ca_file needs tls_cert_file"]),
    ("agent", {"TPFLEX_ETCD__CA_FILE": "/no/such/ca.pem"}, ["not a readable file", "/no/such/ca.pem"]),
])
def test_incomplete_tls_settings_are_refused(certs, service, env, words):
    env = {k: v.format(ca=certs / "ca.pem", cert=certs / "controller.pem") for k, v in env.items()}
    _refused(call_service(service, "--print-config", env=env), *words)


def test_a_bad_token_file_stops_the_controller_at_start(tmp_path):
    tokens = tmp_path / "admin.tokens"
    tokens.write_text("one two three\n")
    result = _run("controller", "--etcd", "127.0.0.1:9", "--rest-listen", "127.0.0.1:0",
                  "--trainer-listen", "127.0.0.1:0", "--admin-tokens-file", str(tokens))
    _refused(result, str(tokens), "whitespace")


def test_tokens_are_never_command_line_arguments():
    result = call_service("controller", "--admin-token", "secret", "--print-config")
    assert result.returncode == 2 and "unrecognized arguments" in result.stderr
    options = [w for w in call_service("controller", "--help").stdout.split() if w.startswith("--")]
    assert [o for o in options if "token" in o] == ["--admin-tokens-file", "--readonly-tokens-file"]
