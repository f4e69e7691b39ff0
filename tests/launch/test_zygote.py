"""The preloading launch (tpflex_trainer/launch/zygote.py): a rank forked from the zygote
sees what ``subprocess.Popen`` of the same command would have given it (checked against
Popen running the same script: argv, cwd, environment, its own session, ``__main__``,
``sys.path[0]``, stdin/stdout/stderr, atexit, exit status), signals reach it and its exit
status says so, and commands it cannot run are left to Popen."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tpflex_trainer.launch.zygote import Entry, Zygote, ZygoteError, entry_of

CHILD = str(Path(__file__).parent / "zygote_child.py")
PRELOAD = ["email.mime.text"]  # cheap, and never imported by the child itself
# the interpreter's start-up settings come from the zygote's environment (a caveat of
# preloading): both it and Popen get the repository on PYTHONPATH (tests.launch.zygote_child)
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}


@pytest.fixture(scope="module")
def zygote():
    z = Zygote(sys.executable, PRELOAD, env=ENV, wait=False)  # the first spawn waits for its imports
    try:
        yield z
    finally:
        z.close()


def test_entry_of_takes_python_scripts_and_modules_only():
    assert entry_of(["python3", "train.py", "--lr", "1"]) == Entry("script", "train.py", ("--lr", "1"))
    assert entry_of(["/venv/bin/python3.11", "-m", "pkg.train", "-x"]) == Entry("module", "pkg.train", ("-x",))
    for command in (["torchrun", "train.py"], ["python"], ["python", "-m"], ["python", "-u", "train.py"],
                    ["python", "-c", "print(1)"], ["bash", "-c", "python train.py"]):
        assert entry_of(command) is None, command


def _both(zygote: Zygote, command: list[str], tmp: Path, env: dict[str, str] | None = None,
          stdin: bytes = b"") -> tuple[tuple[int, str, str], tuple[int, str, str]]:
    """(status, stdout, stderr) of ``command`` started by Popen, then by the zygote."""
    env = {**ENV, "ZYGOTE_TEST": "yes", **(env or {})}
    cwd = tmp / "cwd"
    cwd.mkdir(exist_ok=True)
    popen = subprocess.run(command, env=env, cwd=cwd, input=stdin, capture_output=True, timeout=60,
                           start_new_session=True)
    paths = [tmp / n for n in ("in", "out", "err")]
    paths[0].write_bytes(stdin)
    with open(paths[0], "rb") as i, open(paths[1], "wb") as o, open(paths[2], "wb") as e:
        proc = zygote.spawn(entry_of(command), command, env, cwd=str(cwd), stdin=i.fileno(), stdout=o.fileno(),
                            stderr=e.fileno())
    code = proc.wait(60)
    return ((popen.returncode, popen.stdout.decode(), popen.stderr.decode()),
            (code, paths[1].read_text(), paths[2].read_text()))


def _facts(stdout: str) -> dict:
    return json.loads(stdout.splitlines()[0])


@pytest.mark.parametrize(("command", "status"), [([sys.executable, CHILD, "exit:3", "b c"], 3),
                                                 ([sys.executable, "-m", "tests.launch.zygote_child", "exit:0"], 0)],
                         ids=["script", "module"])
def test_a_forked_rank_sees_what_popen_gives_it(zygote, tmp_path, command, status):
    (p_code, p_out, p_err), (z_code, z_out, z_err) = _both(zygote, command, tmp_path, stdin=b"the input")
    p_facts, z_facts = _facts(p_out), _facts(z_out)
    # the only difference: the zygote had imported the preloaded module already
    assert (p_facts.pop("preloaded"), z_facts.pop("preloaded")) == (False, True)
    assert z_facts == p_facts and p_facts["env"] == "yes" and p_facts["sid_is_pid"] and p_facts["name"] == "__main__"
    assert p_facts["stdin"] == "the input" and p_facts["cwd"] == str(tmp_path / "cwd")
    assert z_out.splitlines()[1:] == p_out.splitlines()[1:] == ["atexit ran"]
    assert (z_code, z_err) == (p_code, p_err) and p_code == status


@pytest.mark.parametrize("how", ["raise", "message"])
def test_an_error_leaving_the_rank_is_its_status_and_its_stderr(zygote, tmp_path, how):
    (p_code, _, p_err), (z_code, _, z_err) = _both(zygote, [sys.executable, CHILD, how], tmp_path)
    assert z_code == p_code == 1
    assert z_err.splitlines()[-1] == p_err.splitlines()[-1]
    assert ("RuntimeError: the rank's own error" if how == "raise" else "a message to stderr") in z_err


def test_signals_reach_the_rank_and_its_session_and_its_status_tells(zygote, tmp_path):
    zygote.proc.send_signal(signal.SIGTERM)  # a scheduler signalling the whole job: the launcher's
    zygote.proc.send_signal(signal.SIGINT)  # to handle, the zygote stays
    out = tmp_path / "out"
    with open(out, "wb") as o:
        proc = zygote.spawn(entry_of([sys.executable, CHILD, "wait"]), [CHILD], dict(os.environ), stdout=o.fileno())
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)  # still running: no status yet
    waiting = _wait_text(out, "waiting")
    assert os.getsid(proc.pid) == proc.pid and os.getpgid(proc.pid) == proc.pid and waiting
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM and proc.poll() == -signal.SIGTERM
    assert zygote.proc.poll() is None


def test_a_rank_whose_zygote_died_is_killed_and_reported_so(tmp_path):
    z = Zygote(sys.executable, PRELOAD, env=ENV)
    out = tmp_path / "out"
    with open(out, "wb") as o:
        proc = z.spawn(entry_of([sys.executable, CHILD, "wait"]), [CHILD], dict(os.environ), stdout=o.fileno())
    _wait_text(out, "waiting")
    z.proc.kill()  # nobody can tell the rank's exit any more
    assert proc.wait(30) == -signal.SIGKILL
    from tests.support.wait import wait_until
    wait_until(lambda: not _alive(proc.pid), 30, "the orphaned rank to be gone")
    z.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its new parent counts as gone
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _wait_text(path: Path, text: str) -> bool:
    from tests.support.wait import wait_until
    return wait_until(lambda: text in path.read_text(), 30, f"{text!r} in {path}")


def test_a_zygote_that_cannot_preload_says_why(tmp_path):
    with pytest.raises(ZygoteError, match="No module named 'no_such_module_here'"):
        Zygote(sys.executable, ["no_such_module_here"])
    late = Zygote(sys.executable, ["no_such_module_here"], wait=False)  # told at the first spawn
    with pytest.raises(ZygoteError, match="No module named 'no_such_module_here'"):
        late.spawn(entry_of([sys.executable, CHILD, "exit:0"]), [CHILD], dict(os.environ))
    assert late.proc.wait(10) == 1
