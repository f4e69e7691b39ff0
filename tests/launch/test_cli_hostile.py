"""Hostile arguments to ``tpflex-run`` as a real process: each exits 2 with one line naming
the argument, no traceback, before any rank starts (docs/launch.md). Found by review:
a job spec that is not UTF-8 and a huge ``--nproc-per-node`` gave tracebacks; a ``--tls-ca``
that is a directory or not PEM passed the start-up check and then killed the launcher's
store keep-alive thread; an invalid ``--controller``, a job name with ``/`` and spaces
were accepted and the ranks started; an unusable ``--log-dir`` did not name the option.
Also: the keep-alive thread logs an unexpected error and goes on instead of dying."""

from __future__ import annotations

import logging
import subprocess

import pytest
from tpflex_trainer.hooks.control import ControlConfig
from tpflex_trainer.launch.keepalive import StoreKeepAlive

from tests.launch.support import CHILD, RUN, Launcher, base_env, job_spec
from tests.support.wait import wait_until

# A self-signed CA certificate (public, EC P-256, valid until 2126): a usable --tls-ca.
TEST_CA_PEM = """\
-----BEGIN CERTIFICATE-----
MIIBijCCAS+gAwIBAgIUIpfb/LCkWclqrNeobD9NlCgdMhcwCgYIKoZIzj0EAwIw
GTEXMBUGA1UEAwwOdHBmbGV4LXRlc3QtY2EwIBcNMjYxMjAzMTM0NDI1WhgPMjEy
NjExMDkxMzQ0MjVaMBkxFzAVBgNVBAMMDnRwZmxleC10ZXN0LWNhMFkwEwYHKoZI
zj0CAQYIKoZIzj0DAQcDQgAEjxZwT6J4YLecnJTpfIQwrAbHi3NdpXwSR4XUhODF
/zqQK9+rMCfLAH7doZdQcbMJcegHIqPM52m0S/+HRklXJKNTMFEwHQYDVR0OBBYE
FKmsOfZb9dWh+Mt6xZ1ZpywQtsYvMB8GA1UdIwQYMBaAFKmsOfZb9dWh+Mt6xZ1Z
pywQtsYvMA8GA1UdEwEB/wQFMAMBAf8wCgYIKoZIzj0EAwIDSQAwRgIhAKXMuIbF
xepdLffb+/9WjlWCSUPukgkw1lUTk+mb09qHAiEA0iYaE+LLdmc0XlA8zesTbr3B
kwMr+xT2FgR746xtkDM=
-----END CERTIFICATE-----
"""


def refused(tmp_path, args, env=None):
    """tpflex-run with stand-in ranks that record their start and exit at once: (exit
    status, stderr, whether any rank started)."""
    records = tmp_path / "records"
    records.mkdir(exist_ok=True)
    for old in records.iterdir():
        old.unlink()
    proc = subprocess.run([RUN, *args, "--", *CHILD], capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False,
                          env=base_env(RECORDS_DIR=str(records), CHILD_MODE="once", **(env or {})))
    return proc.returncode, proc.stderr, any(records.iterdir())


def assert_refused(tmp_path, args, message, env=None):
    code, err, started = refused(tmp_path, args, env)
    errors = [line for line in err.splitlines() if line.startswith("tpflex-run: error:")]
    assert code == 2 and len(errors) == 1 and message in errors[0], (args, code, err)
    assert "Traceback" not in err and "launching" not in err, (args, err)
    assert not started, (args, "a rank started", err)


@pytest.fixture
def ok(tmp_path):
    spec = job_spec(tmp_path / "job.json", nodes={"n0": 2})
    return ["--controller", "c:1", "--job-spec", str(spec), "--node", "n0"]


def test_a_job_spec_that_is_not_utf8_is_refused(tmp_path, ok):
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert_refused(tmp_path, [*ok[:3], str(binary), *ok[4:]], f"--job-spec: {binary} is not a JobSpec: not UTF-8")


@pytest.mark.parametrize("count", ["10000000000000", "1025"])
def test_nproc_per_node_is_bounded_like_gpus(tmp_path, ok, count):
    assert_refused(tmp_path, [*ok, "--nproc-per-node", count], "argument --nproc-per-node: must be within 1..1024")


def test_unusable_tls_files_are_refused_at_start_naming_the_option(tmp_path, ok):
    ca = tmp_path / "ca.pem"
    ca.write_text(TEST_CA_PEM)
    junk = tmp_path / "junk.pem"
    junk.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n")
    adir = tmp_path / "adir"
    adir.mkdir()
    for args, env, message in [
        (["--tls-ca", str(adir)], None, f"--tls-ca: cannot read CA file '{adir}': Is a directory"),
        ([], {"TPFLEX_TLS_CA": str(adir)}, "--tls-ca: cannot read CA file"),
        (["--tls-ca", str(junk)], None, f"--tls-ca: CA file '{junk}' holds no usable PEM certificate"),
        (["--tls-ca", str(ca), "--tls-cert", str(ca), "--tls-key", str(adir)], None,
         f"--tls-key: cannot read key '{adir}'"),
        (["--tls-ca", str(ca), "--tls-cert", str(adir), "--tls-key", str(junk)], None,
         f"--tls-cert: cannot read certificate '{adir}'"),
        (["--tls-ca", str(ca), "--tls-cert", str(junk), "--tls-key", str(junk)], None,
         "--tls-cert: certificate"),
        (["--tls-ca", str(ca), "--tls-cert", str(ca)], None, "--tls-cert: --tls-cert and --tls-key go together"),
        (["--tls-ca", str(ca), "--tls-key", str(junk)], None, "--tls-key: --tls-cert and --tls-key go together"),
        (["--tls-cert", str(ca), "--tls-key", str(junk)], None, "--tls-cert: needs --tls-ca"),
    ]:
        assert_refused(tmp_path, [*ok, *args], message, env)


def test_endpoints_that_are_not_host_port_are_refused(tmp_path, ok):
    for args, env, message in [
        (["--controller", "ctl:99999", *ok[2:]], None, "--controller: 'ctl:99999' is not HOST:PORT"),
        (["--controller", "ctl", *ok[2:]], None, "--controller: 'ctl' is not HOST:PORT"),
        (["--controller", "c:1,a b:2", *ok[2:]], None, "--controller: 'a b:2' is not HOST:PORT"),
        (ok[2:], {"TPFLEX_CONTROLLER": "c:1,ctl:"}, "--controller: 'ctl:' is not HOST:PORT"),
        ([*ok, "--store", "store-host"], None, "--store: 'store-host' is not HOST:PORT"),
        ([*ok, "--store", "tpflex://a:1,b:70000"], None, "--store: 'b:70000' is not HOST:PORT"),
    ]:
        assert_refused(tmp_path, args, message, env)


@pytest.mark.parametrize("name", ["a/b c", "my job", "-lead", ""])
def test_a_job_name_the_control_plane_refuses_is_refused(tmp_path, name):
    spec = job_spec(tmp_path / "bad.json", name=name, nodes={"n0": 1})
    assert_refused(tmp_path, ["--controller", "c:1", "--job-spec", str(spec), "--node", "n0"],
                   f"--job-spec: job name {name!r} must be 1-128 letters")


def test_an_unusable_log_dir_is_named(tmp_path, ok):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert_refused(tmp_path, [*ok, "--log-dir", str(a_file)], f"--log-dir: cannot create {a_file}: File exists")
    assert_refused(tmp_path, [*ok, "--log-dir", str(a_file / "sub")], "--log-dir: cannot create")


def test_good_arguments_of_the_same_kinds_still_start_the_ranks(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text(TEST_CA_PEM)
    spec = job_spec(tmp_path / "job.json", name="job_1.x-2", nodes={"n0": 2})
    run = Launcher(tmp_path, ["--controller", "[::1]:8471, ctl-0.example:0", "--job-spec", str(spec), "--node", "n0",
                              "--nproc-per-node", "2", "--store", "tpflex://s1:1,s2:65535", "--tls-ca", str(ca),
                              "--log-dir", str(tmp_path / "logs" / "new")], env={"CHILD_MODE": "once"})
    try:
        assert run.wait() == 0, run.log()
        assert all(len(run.events(r, "start")) == 1 for r in (0, 1)), run.log()
    finally:
        run.close()


def test_the_keepalive_thread_logs_an_unexpected_error_and_goes_on(tmp_path, caplog):
    """A TLS CA that became a directory after the start: opening the channel raises
    TlsFilesError (tpflex_proto.tls: "Is a directory"), which is neither StoreRefused nor
    StoreUnreachable. The thread died at the first try; now it logs the error (the
    traceback once) and retries."""
    config = ControlConfig(endpoints=("127.0.0.1:9",), job="j", rank=0, call_timeout_s=1.0,
                           tls_ca_file=str(tmp_path))
    caplog.set_level(logging.WARNING, logger="tpflex_run")
    keepalive = StoreKeepAlive(config, retry_s=0.05).start()

    def errors():
        return [r for r in caplog.records if "rendezvous keep-alive error" in r.getMessage()]

    try:
        wait_until(lambda: len(errors()) >= 3 or not keepalive._thread.is_alive(), 30, "three keep-alive errors")
        assert keepalive._thread.is_alive(), "the keep-alive thread died"
    finally:
        keepalive.stop()
    assert not keepalive._thread.is_alive()
    logged = errors()
    assert keepalive.failed >= 3 and "TlsFilesError" in logged[0].getMessage() \
        and "Is a directory" in logged[0].getMessage(), [r.getMessage() for r in logged]
    assert logged[0].exc_info and not any(r.exc_info for r in logged[1:])  # the traceback once
