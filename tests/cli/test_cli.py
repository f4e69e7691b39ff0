"""``tpflexctl`` against a live controller API (real etcd, real uvicorn): human tables,
``--json``, the server's error messages and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tpflex_cli import main as cli
from tpflex_proto import keys

from tests.controller import api_harness as h
from tests.support.ports import free_port


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    base = tmp_path_factory.mktemp("cli")
    with h.served_api(base) as served:
        served.admin_file = base / "admin.token"
        served.admin_file.write_text(h.ADMIN + "\n")
        served.reader_file = base / "reader.token"
        served.reader_file.write_text(f"# read-only\n{h.READER}\n")
        yield served


@pytest.fixture
def ctl(api, capsys, monkeypatch):
    monkeypatch.delenv("TPFLEX_TOKEN_FILE", raising=False)
    monkeypatch.setenv("TPFLEX_URL", api.url)

    def run(*argv: str, token: Path | None = None) -> tuple[int, str, str]:
        args = (["--token-file", str(token)] if token else []) + list(argv)
        code = cli.main(args)
        out, err = capsys.readouterr()
        return code, out, err

    run.served = api
    return run


def test_read_commands_print_tables(ctl):
    code, out, _ = ctl("racks")
    assert code == 0 and out.splitlines()[0].split()[:3] == ["RACK", "DOMAIN", "NODES"]
    assert "rack-a" in out and "rack-b" in out
    code, out, _ = ctl("nodes")
    assert code == 0 and "rack-b-n1" in out and "sim" in out
    code, out, _ = ctl("jobs")
    assert code == 0 and h.JOB in out and "8,8" in out
    code, out, _ = ctl("plan", h.JOB)
    assert code == 0 and "generation 1" in out and "REPLICA" in out
    code, out, _ = ctl("plan", h.JOB, "--history")
    assert code == 0 and out.splitlines()[1].split()[0] == "1"
    code, out, _ = ctl("events", "--limit", "2")
    assert code == 0 and "cause-3" in out and "cause-1" not in out
    code, out, _ = ctl("status")
    assert code == 0 and "leader:   ctl-1" in out and "healthy=16" in out
    code, out, _ = ctl("gpus", "--state", "healthy")
    assert code == 0 and len(out.splitlines()) == 1 + 16


def test_json_output_is_the_server_response(ctl):
    code, out, _ = ctl("--json", "jobs")
    assert code == 0
    jobs = json.loads(out)
    assert jobs == ctl.served.http.get("/v1/jobs").json()


def test_drain_undrain_and_reconfigure_with_a_token_file(ctl):
    store = ctl.served.store
    code, out, _ = ctl("drain", "rack-a-n0", "1", "--reason", "bad fan", token=ctl.served.admin_file)
    assert code == 0 and "drained GPU rack-a-n0:1" in out
    assert store.gpu_overrides()[("rack-a-n0", 1)].reason == "bad fan"
    code, out, _ = ctl("undrain", "rack-a-n0", "1", token=ctl.served.admin_file)
    assert code == 0 and "undrained" in out and store.gpu_overrides() == {}
    code, out, _ = ctl("reconfigure", h.JOB, "--pin", "1=6", "--policy", "ntp", token=ctl.served.admin_file)
    assert code == 0 and "replica 1 -> TP 6" in out
    override = store.job_override(h.JOB)
    assert [(p.replica, p.tp_degree) for p in override.pins] == [(1, 6)] and override.policy == "ntp"


def test_dry_run_commits_nothing(ctl):
    before = ctl.served.etcd.get(keys.job_plan(h.JOB)).mod_revision
    code, out, _ = ctl("dry-run", h.JOB, "--fail", "rack-b-n1:0", "--fail", "rack-b-n1:1")
    assert code == 0 and "nothing committed" in out and "rack-b-n1:0" in out
    code, out, _ = ctl("--json", "dry-run", h.JOB, "--fail", "rack-b-n1:0")
    assert json.loads(out)["plan"]["replicas"][1]["tp_degree"] == 7
    assert ctl.served.etcd.get(keys.job_plan(h.JOB)).mod_revision == before


def test_server_errors_are_printed_and_exit_2(ctl):
    code, out, err = ctl("drain", "rack-a-n0", "1", "--reason", "x")
    assert code == 2 and out == "" and "missing bearer token" in err and "401" in err
    code, _, err = ctl("drain", "rack-a-n0", "1", "--reason", "x", token=ctl.served.reader_file)
    assert code == 2 and "read-only" in err and "403" in err
    code, _, err = ctl("reconfigure", h.JOB, "--pin", "0=9", token=ctl.served.admin_file)
    assert code == 2 and "above the job's base TP degree 8" in err
    code, _, err = ctl("plan", "nope")
    assert code == 2 and "job 'nope' not found" in err
    code, _, err = ctl("dry-run", h.JOB, "--fail", "rack-a-n0:9")
    assert code == 2 and "does not exist" in err
    assert ctl.served.store.gpu_overrides() == {}


def test_usage_and_connection_errors(ctl, tmp_path):
    code, _, err = ctl("reconfigure", h.JOB, "--pin", "one=7")
    assert code == 2 and "expected REPLICA=TP" in err
    code, _, err = ctl("dry-run", h.JOB, "--fail", "nocolon")
    assert code == 2 and "NODE:GPU" in err
    code, _, err = ctl("drain", "n", "0", "--reason", "x", token=tmp_path / "missing")
    assert code == 2 and "cannot read token file" in err
    code, _, err = ctl("--url", f"http://127.0.0.1:{free_port()}", "status")
    assert code == 1 and "cannot reach the tpflex controller" in err
    code, _, err = ctl("--url", "ftp://x", "status")
    assert code == 2 and "invalid --url" in err


def test_hostile_arguments_and_files_are_one_line_and_exit_2(ctl, tmp_path):
    """Each of these ended in a Python traceback (exit 1), or, for the digits, was taken
    and applied (drain '٣' drained GPU 3): ``int`` and ``str.isdigit`` accept more than the
    API's ASCII digits."""
    files = {"u.tok": "tökén€\n".encode(), "bin.tok": b"\xff\xfe\n", "nan.json": b'{"base_tp": NaN}',
             "deep.json": b"[" * 100_000 + b"]" * 100_000}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    before = ctl.served.etcd.get_prefix(keys.PREFIX)[1]
    cases = [
        (["--url", "http://[::1", "status"], "invalid --url"),
        (["--url", "http://127.0.0.1:abc", "status"], "invalid --url"),
        (["--url", "http://" + "a" * 64, "status"], "invalid --url"),
        (["--token-file", str(tmp_path / "u.tok"), "status"], "not printable ASCII"),
        (["--token-file", str(tmp_path / "bin.tok"), "status"], "not UTF-8"),
        (["set-spec", h.JOB, "--file", str(tmp_path / "deep.json")], "nested too deeply"),
        (["set-spec", h.JOB, "--file", str(tmp_path / "nan.json")], "NaN"),
        (["drain", "rack-a-n1", "٣", "--reason", "x"], "expected a GPU index"),
        (["drain", "rack-a-n1", " +1", "--reason", "x"], "expected a GPU index"),
        (["undrain", "rack-a-n1", "1_0"], "expected a GPU index"),
        (["reconfigure", h.JOB, "--pin", "0=٤"], "expected REPLICA=TP"),
        (["reconfigure", h.JOB, "--pin", "0=²"], "expected REPLICA=TP"),
        (["dry-run", h.JOB, "--fail", "rack-a-n1:٢"], "NODE:GPU"),
        (["events", "--limit", "٥"], "expected a count"),
    ]
    for argv, words in cases:
        code, _, err = ctl(*argv, token=ctl.served.admin_file if argv[0] == "set-spec" else None)
        assert code == 2, (argv, code, err)
        assert words in err and "Traceback" not in err, (argv, err)
    assert ctl.served.etcd.get_prefix(keys.PREFIX)[1] == before  # nothing was written


def test_console_script_runs_as_a_process(ctl):
    exe = Path(sys.executable).with_name("tpflexctl")
    env = {**os.environ, "TPFLEX_URL": ctl.served.url, "TPFLEX_TOKEN_FILE": str(ctl.served.reader_file)}
    ok = subprocess.run([str(exe), "racks"], env=env, capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and "rack-a" in ok.stdout
    bad = subprocess.run([str(exe), "undrain", "rack-a-n0", "0"], env=env, capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "read-only" in bad.stderr and "Traceback" not in bad.stderr
