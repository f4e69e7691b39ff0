"""``tpflex-run`` as a real process supervising real child processes: a rank killed with
SIGKILL is restarted alone (the survivors keep their processes), restarts are bounded
with backoff, SIGTERM drains every rank (seen in the ranks' own records) and SIGKILLs a
rank that ignores it after the grace period, and the exit status reflects the ranks.
The first test runs two ways: ranks started with Popen and forked by the preloading zygote
(``--preload``: first starts and the restart); two others check ``--preload``'s fallback to
Popen: a zygote that cannot import its modules, a command it cannot run (``python -u``)."""

from __future__ import annotations

import os
import re
import signal
import sys

import pytest
from tpflex_proto import keys

from tests.launch.support import CHILD, Launcher, alive, job_spec
from tests.support.wait import wait_until

COMMON = ["--controller", "127.0.0.1:1", "--store", "127.0.0.1:2", "--node", "n0"]


@pytest.fixture
def spec(tmp_path):
    return str(job_spec(tmp_path / "job.json"))


@pytest.mark.parametrize("start", ["popen", "preload"])
def test_a_killed_rank_is_restarted_alone_and_sigterm_drains_every_rank(tmp_path, spec, start):
    preload = ["--preload", "email.mime.text"] if start != "popen" else []
    run = Launcher(tmp_path, [*COMMON, "--job-spec", spec, "--nproc-per-node", "4", "--backoff-s", "0.05", *preload])
    try:
        first = run.wait_started({r: 1 for r in range(4)})
        pids = {r: first[r][0]["pid"] for r in range(4)}
        os.kill(pids[2], signal.SIGKILL)  # the rank dies without a word
        again = run.wait_started({2: 2})[2]
        assert again[1]["pid"] != pids[2] and again[1]["env"]["TPFLEX_RESTART_COUNT"] == "1"
        assert again[1]["env"]["TPFLEX_GPU"] == "2"  # same GPU, same place in the job
        for r in (0, 1, 3):  # the survivors: same process, never signalled, never restarted
            assert alive(pids[r]) and len(run.events(r, "start")) == 1 and not run.events(r, "sigterm")
        current = {**pids, 2: again[1]["pid"]}

        run.signal(signal.SIGTERM)
        assert run.wait() == 0  # every rank drained and exited 0
        for r in range(4):  # each rank's current process got SIGTERM itself
            assert [e["pid"] for e in run.events(r, "sigterm")] == [current[r]]
            assert not alive(current[r])
        assert "rank died; restarting it" in run.log() and "reason=signal:SIGKILL" in run.log()
        # who started the ranks, the restarted one included: the zygote or tpflex-run itself
        parents = {s["ppid"] for r in range(4) for s in run.events(r, "start")}
        zygote = re.search(r"zygote ready node=n0 preload=email.mime.text pid=(\d+)", run.log())
        if start == "preload":
            assert zygote is not None and parents == {int(zygote.group(1))} != {run.proc.pid}, run.log()
        else:
            assert zygote is None and parents == {run.proc.pid}
    finally:
        run.close()


def test_a_rank_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path, spec):
    # a zygote that cannot preload its modules: the ranks are started with Popen
    run = Launcher(tmp_path, [*COMMON, "--job-spec", spec, "--gpus", "0-1", "--grace-period-s", "1",
                              "--preload", "no_such_module_here"], env={"STUBBORN_RANK": "1"})
    try:
        first = run.wait_started({0: 1, 1: 1})
        assert {s[0]["ppid"] for s in first.values()} == {run.proc.pid}
        assert "--preload: no zygote (preloading no_such_module_here: ModuleNotFoundError" in run.log()
        run.signal(signal.SIGINT)  # Ctrl-C: the same drain
        assert run.wait() == 128 + signal.SIGKILL  # the stubborn rank was killed
        assert len(run.events(0, "sigterm")) == 1 and len(run.events(1, "sigterm")) == 1
        assert not alive(first[1][0]["pid"])
        assert "grace period over" in run.log()
    finally:
        run.close()


def test_restarts_are_bounded_with_backoff_and_the_others_run_on(tmp_path, spec):
    run = Launcher(tmp_path, [*COMMON, "--job-spec", spec, "--nproc-per-node", "3", "--max-restarts", "2",
                              "--backoff-s", "0.2"], env={"CRASH_RANK": "1", "CRASH_CODE": "5"})
    try:
        starts = run.wait_started({0: 1, 1: 3, 2: 1})
        wait_until(lambda: "rank given up" in run.log(), 30, "the crashing rank to be given up")
        crashes = starts[1]
        assert [s["env"]["TPFLEX_RESTART_COUNT"] for s in crashes] == ["0", "1", "2"]
        # backoff doubles: at least 0.2 s before the first restart, 0.4 s before the second
        assert crashes[1]["t"] - crashes[0]["t"] >= 0.2
        assert crashes[2]["t"] - crashes[1]["t"] >= 0.4
        assert len(run.events(1, "start")) == 3  # given up: not started again
        for r in (0, 2):
            assert len(run.events(r, "start")) == 1 and not run.events(r, "sigterm")
            os.kill(starts[r][0]["pid"], signal.SIGUSR1)  # the others finish their work
        assert run.wait() == 5  # the launcher's status is the given-up rank's
        assert "rank given up node=n0 local_rank=1 gpu=1 reason=exit:5" in run.log()
    finally:
        run.close()


def test_ranks_that_finish_are_not_restarted_and_the_status_is_theirs(tmp_path, spec):
    # --preload, but `python -u SCRIPT` is not a command the zygote runs: Popen
    run = Launcher(tmp_path, [*COMMON, "--job-spec", spec, "--nproc-per-node", "2", "--preload", "email.mime.text"],
                   env={"FINISH_CODE": "0"}, command=[sys.executable, "-u", *CHILD[1:]])
    try:
        starts = run.wait_started({0: 1, 1: 1})
        assert {s[0]["ppid"] for s in starts.values()} == {run.proc.pid} and "zygote ready" not in run.log()
        assert "--preload: not a `python SCRIPT` or `python -m MODULE` command" in run.log()
        for r in (0, 1):
            os.kill(starts[r][0]["pid"], signal.SIGUSR1)
        assert run.wait() == 0
        assert all(len(run.events(r, "start")) == 1 for r in (0, 1))
    finally:
        run.close()


def test_the_launcher_keeps_the_jobs_rendezvous_store_alive(tmp_path, served):
    job = served.new_job("kept")
    spec = str(job_spec(tmp_path / "job.json", name=job, nodes={"n0": 1}))
    run = Launcher(tmp_path, ["--controller", served.endpoint, "--job-spec", spec, "--node", "n0"])
    try:
        run.wait_started({0: 1})
        # no rank touches the store here: only the launcher's keep-alive creates its lease
        wait_until(lambda: served.etcd.get(keys.rendezvous_lease(job)) is not None, 20,
                   "the launcher's keep-alive to establish the job's store lease")
        run.signal(signal.SIGTERM)
        assert run.wait() == 0
    finally:
        run.close()
