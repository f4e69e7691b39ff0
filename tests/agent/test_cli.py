"""The tpflex-agent command line and its settings: precedence and clear errors."""

from __future__ import annotations

import json

import pytest
from tpflex_agent.main import main
from tpflex_agent.settings import ConfigError, load_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("TPFLEX_"):
            monkeypatch.delenv(name)
    monkeypatch.delenv("FAKE_NVML_STATE", raising=False)


def test_precedence_argument_over_environment_over_file_over_default(tmp_path):
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[agent]\nrack = "from-file"\nnode = "n-file"\n[etcd]\nlease_ttl_s = 7\n')
    env = {"TPFLEX_AGENT__RACK": "from-env", "TPFLEX_ETCD__ENDPOINTS": "127.0.0.1:1,127.0.0.1:2",
           "TPFLEX_GRPC__INSECURE": "true"}
    plain = {"grpc": {"insecure": True}}  # plaintext gRPC is an explicit choice
    s = load_settings({"agent": {"rack": "from-arg"}, **plain}, env, str(cfg))
    assert (s.rack, s.node, s.etcd.lease_ttl_s) == ("from-arg", "n-file", 7)
    assert s.etcd.endpoints == ["127.0.0.1:1", "127.0.0.1:2"]
    assert load_settings({}, env, str(cfg)).rack == "from-env"
    assert load_settings(plain, {}, str(cfg)).rack == "from-file"
    # no rack configured: chosen at start from the NVLink fabric, else rack0 (tpflex_agent.fabric)
    assert load_settings(plain, {}).rack == "" and load_settings(plain, {}).health.debounce_s == 1.0
    as_json = load_settings(plain, {"TPFLEX_ETCD__ENDPOINTS": '["https://10.0.0.1:2379", "10.0.0.2:2379"]'})
    assert as_json.etcd.endpoints == ["10.0.0.1:2379", "10.0.0.2:2379"]


def test_plaintext_grpc_needs_an_explicit_insecure(capsys, tmp_path):
    with pytest.raises(ConfigError, match="needs an explicit --insecure"):
        load_settings({}, {})
    assert main(["--backend", "sim", "--print-config"]) == 2
    assert "gRPC without TLS needs an explicit --insecure" in capsys.readouterr().err
    assert main(["--backend", "sim", "--insecure", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["grpc"]["insecure"] is True
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(ConfigError, match="contradicts"):
        load_settings({"grpc": {"insecure": True, "tls_cert_file": str(cert), "tls_key_file": str(cert)}}, {})


def test_the_deploy_example_has_only_known_keys():
    with pytest.raises(ConfigError) as err:  # its TLS files do not exist here
        load_settings({}, {}, "deploy/config/agent.toml")
    assert "unknown configuration key" not in str(err.value)
    assert "is not a readable file" in str(err.value)


@pytest.mark.parametrize("argv,env,file_text,words", [
    (["--sim-gpus", "0"], {}, None, "agent.sim_gpus (from command line)"),
    ([], {"TPFLEX_ETCD__LEASE_TTL_S": "0"}, None, "etcd.lease_ttl_s (from environment TPFLEX_ETCD__LEASE_TTL_S)"),
    ([], {"TPFLEX_AGENT__COLOUR": "red"}, None, "unknown configuration key 'agent.colour' in environment variable TPFLEX_AGENT__COLOUR"),
    ([], {}, "[agent]\nbakend = 'sim'\n", "unknown configuration key 'agent.bakend' in config file"),
    ([], {}, "[agent\n", "is not valid TOML"),
    (["--listen", "nowhere"], {}, None, "listen must be HOST:PORT"),
    (["--etcd", "localhost:99999"], {}, None, "etcd endpoint must be HOST:PORT"),
    (["--node", "bad/name"], {}, None, "agent.node (from command line)"),
    # what the agent registers and the controller dials
    (["--advertise-address", "not a host port!"], {}, None, "advertise_address must be HOST:PORT"),
    (["--advertise-address", "node7:0"], {}, None, "advertise_address needs a port in 1..65535"),
    ([], {"TPFLEX_METRICS__ADVERTISE_ADDRESS": "node7"}, None, "metrics.advertise_address"),
    ([], {"TPFLEX_ETCD__DIAL_TIMEOUT_S": "inf"}, None, "finite number"),
])
def test_bad_configuration_exits_2_with_a_message(tmp_path, monkeypatch, capsys, argv, env, file_text, words):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if file_text is not None:
        cfg = tmp_path / "agent.toml"
        cfg.write_text(file_text)
        argv = [*argv, "--config", str(cfg)]
    assert main(["--backend", "sim", "--insecure", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tpflex-agent: error: ") and words in err and "Traceback" not in err


def test_unknown_flag_and_bad_backend_exit_2(capsys):
    assert main(["--backend", "cuda"]) == 2
    assert "agent.backend (from command line): Input should be 'nvml' or 'sim'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--frobnicate"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --frobnicate" in capsys.readouterr().err


def test_missing_nvidia_driver_is_a_clear_error(capsys):
    assert main(["--backend", "nvml", "--insecure", "--listen", "127.0.0.1:0", "--metrics-port", "0"]) == 2
    err = capsys.readouterr().err
    assert "no NVIDIA driver found; use --backend sim" in err and "Traceback" not in err


def test_print_config(capsys):
    assert main(["--backend", "sim", "--insecure", "--rack", "r9", "--metrics-port", "0", "--print-config"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["agent"]["rack"] == "r9" and cfg["metrics"]["listen"] == "0.0.0.0:0"
