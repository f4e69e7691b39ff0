"""``tpflexctl`` for daily use: pagination, ``--cacert`` over real HTTPS, ``--watch`` on the
console's live stream (a real tpflexctl process), shell completion run by a real bash."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import uvicorn
from tpflex_cli import client as cli_http
from tpflex_cli import main as cli
from tpflex_controller.api import create_app
from tpflex_controller.api.cache import ApiStateCache
from tpflex_controller.devtools.secure_etcd import CertSet, make_dev_certs
from tpflex_controller.store import Store
from tpflex_proto import codec, keys, types_pb2
from tpflex_proto.etcd import Etcd

from tests.controller import api_harness as h
from tests.support.etcd_server import EtcdCluster
from tests.support.ports import free_port
from tests.support.wait import wait_until

TPFLEXCTL = str(Path(sys.executable).parent / "tpflexctl")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The API over the watch-fed view (what the controller serves), seeded, with token files."""
    base = tmp_path_factory.mktemp("cli-daily")
    cluster = EtcdCluster(1, base / "etcd").start()
    etcd = Etcd(cluster.endpoints, timeout=2.0)
    h.seed(Store(etcd))
    deps = h.make_deps(etcd, h.write_token_file(base))
    deps.state = ApiStateCache(etcd).start()
    server = h.ServedApp(create_app(deps)).start()
    (base / "reader.token").write_text(h.READER + "\n")
    try:
        wait_until(lambda: httpx.get(server.url + "/readyz").status_code == 200, 15, "the API's view")
        yield server, etcd, base / "reader.token"
    finally:
        server.stop()
        deps.state.stop()
        etcd.close()
        cluster.stop()


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_lists_are_read_page_by_page(live, capsys, monkeypatch):
    server, _, _ = live
    monkeypatch.setattr(cli_http, "PAGE", 3)  # 16 GPUs: six requests
    code, out, err = run(capsys, "--url", server.url, "--json", "gpus")
    assert code == 0, err
    gpus = [(g["node"], g["index"]) for g in json.loads(out)]
    assert gpus == sorted(gpus) and len(set(gpus)) == 16
    code, out, err = run(capsys, "--url", server.url, "gpus", "--limit", "5")
    assert code == 0 and len(out.strip().splitlines()) == 1 + 5
    cursor = err.strip().rsplit("--after ", 1)[1]
    assert cursor == "rack-a-n1:0000000"
    code, out, _ = run(capsys, "--url", server.url, "gpus", "--limit", "5", "--after", cursor)
    assert out.splitlines()[1].split()[:2] == ["rack-a-n1", "1"]
    code, _, err = run(capsys, "--url", server.url, "racks", "--limit", "0")
    assert code == 2 and "--limit" in err


@pytest.fixture(scope="module")
def https(tmp_path_factory, live):
    """The same app over HTTPS with the development CA's controller certificate."""
    certs = CertSet(make_dev_certs(tmp_path_factory.mktemp("certs")))
    server, _, _ = live
    port = free_port()
    config = uvicorn.Config(server.server.config.app, host="127.0.0.1", port=port, log_level="warning",
                            lifespan="off", ssl_certfile=certs.cert("controller"),
                            ssl_keyfile=certs.key("controller"))
    tls = uvicorn.Server(config)
    thread = threading.Thread(target=tls.run, daemon=True)
    thread.start()
    wait_until(lambda: tls.started, 15, "the HTTPS server")
    yield f"https://127.0.0.1:{port}", certs
    tls.should_exit = True
    thread.join(10)


def test_cacert_verifies_the_controller_and_refuses_without_it(https, capsys, tmp_path):
    url, certs = https
    code, out, err = run(capsys, "--url", url, "--cacert", certs.ca, "status")
    assert code == 0, err
    assert "leader:   ctl-1" in out
    code, _, err = run(capsys, "--url", url, "status")  # the system CAs do not know it
    assert code == 1 and "CERTIFICATE_VERIFY_FAILED" in err.upper().replace(" ", "_")
    code, _, err = run(capsys, "--url", url.replace("https", "http"), "--cacert", certs.ca, "status")
    assert code == 2 and "--cacert is for https" in err
    code, _, err = run(capsys, "--url", url, "--cacert", str(tmp_path / "missing.pem"), "status")
    assert code == 2 and "--cacert" in err


def _follow(argv: list[str], env_url: str) -> subprocess.Popen:
    env = {**os.environ, "TPFLEX_URL": env_url, "PYTHONFAULTHANDLER": "1"}  # SIGABRT: a traceback
    env.pop("TPFLEX_TOKEN_FILE", None)
    # Ctrl-C must reach it even when this test runs in a background job, whose shell
    # starts it with SIGINT ignored (inherited through exec, and Python then installs no
    # KeyboardInterrupt handler): the child starts with the default disposition
    return subprocess.Popen([TPFLEXCTL, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _lines_until(proc: subprocess.Popen, needle: str, timeout: float = 20.0) -> list[str]:
    lines: list[str] = []
    done = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if needle in line:
                done.set()
                return

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(timeout), f"{needle!r} not printed within {timeout}s: {lines}"
    return lines


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(20)
    except subprocess.TimeoutExpired:  # say where it hangs: faulthandler prints every thread
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"tpflexctl did not stop on SIGINT within 20 s; its threads:\n{err[-6000:]}") from None


def test_events_watch_prints_new_decisions_as_they_are_recorded(live):
    server, etcd, token = live
    proc = _follow(["--token-file", str(token), "events", "--watch", "--limit", "2"], server.url)
    try:
        first = _lines_until(proc, "cause-3")
        assert first[0].split()[:2] == ["SEQ", "AT"] and not any("cause-1" in ln for ln in first)
        ev = types_pb2.Event(seq=4, at=h.NOW + 4, kind="plan", job=h.JOB, generation=2, cause="watched-cause")
        etcd.put(keys.event(4), codec.encode(ev))
        more = _lines_until(proc, "watched-cause")
        assert more[-1].split()[0] == "4" and "SEQ" not in "".join(more)
    finally:
        assert _stop(proc) == 130


def test_plan_watch_prints_each_new_generation(live):
    server, etcd, token = live
    proc = _follow(["--token-file", str(token), "plan", h.JOB, "--watch"], server.url)
    try:
        _lines_until(proc, "generation 1")
        plan = types_pb2.Plan()
        plan.CopyFrom(codec.decode(types_pb2.Plan, etcd.get(keys.job_plan(h.JOB)).value))
        plan.generation, plan.cause = 2, "watched-generation"
        etcd.put(keys.job_plan(h.JOB), codec.encode(plan))
        lines = _lines_until(proc, "generation 2")
        assert "watched-generation" in lines[-1]
    finally:
        assert _stop(proc) == 130
    # a wrong token ends the watch at once with the server's message (exit 2)
    bad = _follow(["plan", h.JOB, "--watch"], server.url)
    assert bad.wait(20) == 2 and "401" in bad.stderr.read()


@pytest.mark.parametrize("words, expected", [
    ("tpflexctl dr", {"drain", "dry-run"}),
    ("tpflexctl gpus --st", {"--state"}),
    ("tpflexctl gpus --state f", {"failed"}),
    ("tpflexctl events --w", {"--watch"}),
    ("tpflexctl --cacert", None),  # a file name: completed by bash from the directory
])
def test_bash_completion_script_completes_commands_options_and_choices(tmp_path, words, expected):
    script = subprocess.run([TPFLEXCTL, "completion", "bash"], capture_output=True, text=True, check=True).stdout
    (tmp_path / "ca.pem").write_text("x")
    parts = words.split(" ")
    if expected is None:  # completing the word after the option: an empty current word
        parts.append('""')
    setup = f"COMP_WORDS=({' '.join(parts)}); COMP_CWORD={len(parts) - 1}; "
    probe = script + "\n" + setup + "_tpflexctl; printf '%s\\n' \"${COMPREPLY[@]}\""
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=10)
    got = set(out.stdout.split())
    assert got == (expected or {"ca.pem"}), out.stderr
