"""Settings precedence and validation; tpflex-controller refuses bad configuration with a
message and exit code 2."""

from __future__ import annotations

import socket
import subprocess

import pytest
from tpflex_controller.settings import ConfigError, load_settings

from tests.controller.controller_harness import CONTROLLER_BIN


def test_precedence_argument_over_environment_over_file_over_default(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[etcd]\nendpoints = ["10.0.0.1:2379"]\nlease_ttl_s = 7\n[rest]\nlisten = "0.0.0.0:9000"\n')
    s = load_settings(config_file=str(cfg), env={})
    assert s.etcd.endpoints == ["10.0.0.1:2379"] and s.etcd.lease_ttl_s == 7
    assert s.trainer.listen == "127.0.0.1:8471"  # default
    env = {"TPFLEX_ETCD__LEASE_TTL_S": "9", "TPFLEX_ETCD__ENDPOINTS": "a:1,b:2"}
    s = load_settings(config_file=str(cfg), env=env)
    assert s.etcd.lease_ttl_s == 9 and s.etcd.endpoints == ["a:1", "b:2"]
    s = load_settings({"etcd": {"lease_ttl_s": 3, "endpoints": None}}, config_file=str(cfg), env=env)
    assert s.etcd.lease_ttl_s == 3 and s.etcd.endpoints == ["a:1", "b:2"]
    assert s.rest.listen == "0.0.0.0:9000"
    assert s.controller.name  # defaulted from the host name


@pytest.mark.parametrize(
    ("file_text", "env", "message"),
    [
        ("[etcd]\nlease_ttl_s = 0\n", {}, "etcd.lease_ttl_s"),
        ("[etcd]\nnope = 1\n", {}, "unknown configuration key 'etcd.nope'"),
        ("[rest]\nlisten = 'nowhere'\n", {}, "HOST:PORT"),
        ("", {"TPFLEX_TRAINER__LISTEN": "x:99999"}, "port in 0..65535"),
        ("", {"TPFLEX_CONTROLLER__DEFAULT_POLICY": "fastest"}, "controller.default_policy"),
        ("[timeouts]\nreaction_bound_s = 1\n", {}, "agent_lease_ttl_s < reaction_bound_s"),
        ("[rest]\nadmin_tokens_file = '/no/such/file'\n", {}, "not a readable file"),
        ("not toml [", {}, "not valid TOML"),
        ("", {"TPFLEX_REST__CPUS": "3-1"}, "rest.cpus (from environment TPFLEX_REST__CPUS): Value error, CPU range"),
        ("[rest]\ncpus = '0,x'\n", {}, "not a CPU list item: 'x'"),
        ("[rest]\ncpus = '65536'\n", {}, "CPU 65536 is out of range"),
        ("[rest]\ncpus = '4096'\n", {}, "CPU 4096 does not exist"),
        # a lower bound alone let inf through: the REST child got it back as JSON null
        ("[rest]\nbusy_wait_s = inf\n", {}, "rest.busy_wait_s (from config file"),
        ("", {"TPFLEX_TIMEOUTS__REACTION_BOUND_S": "nan"}, "finite number"),
        ("[rest]\nadmin_tokens_file = '/'\n", {}, "'/' is not a readable file"),  # a directory
        (b"\xff\xfe[rest]\n", {}, "not valid TOML: not UTF-8"),
        ("a = " + "[" * 3000 + "]" * 3000 + "\n", {}, "not valid TOML"),
        # names are checked on client certificates: without a client CA nobody is asked for one
        ("[trainer]\nclient_names = ['tpflex-trainer']\n", {}, "client_names needs client_ca_file"),
    ],
)
def test_bad_values_are_refused_with_a_message(tmp_path, file_text, env, message):
    cfg = tmp_path / "c.toml"
    cfg.write_bytes(file_text if isinstance(file_text, bytes) else file_text.encode())
    with pytest.raises(ConfigError) as info:
        load_settings(config_file=str(cfg), env=env)
    assert message in str(info.value)


def test_process_exits_2_on_bad_config_and_on_a_taken_port(tmp_path, etcd_server):
    bad = subprocess.run([CONTROLLER_BIN, "--lease-ttl-s", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "lease_ttl_s" in bad.stderr and "Traceback" not in bad.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = subprocess.run(
            [CONTROLLER_BIN, "--etcd", etcd_server.endpoints[0], "--rest-listen", f"127.0.0.1:{port}",
             "--trainer-listen", "127.0.0.1:0"],
            capture_output=True, text=True, timeout=60,
        )
    assert busy.returncode == 2 and "cannot bind the REST API" in busy.stderr
    assert "Traceback" not in busy.stderr


def test_a_bracketed_ipv6_listen_address_from_the_environment_is_accepted():
    s = load_settings(env={"TPFLEX_REST__LISTEN": "[::1]:8470", "TPFLEX_ETCD__ENDPOINTS": '["[::1]:2379", "b:2"]'})
    assert (s.rest.host, s.rest.port, s.etcd.endpoints) == ("::1", 8470, ["[::1]:2379", "b:2"])

