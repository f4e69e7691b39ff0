"""Issue 16, defect 8: ``tpflex-demo --keep-running`` notices a dead service. The demo's
real cluster (etcd, a ``tpflex-controller`` process, two ``tpflex-agent`` processes) is
started without the training story; the controller is killed with SIGKILL.

Before the fix the keep-running loop only waited for Ctrl-C: it never looked at its
services, kept the killed controller as a zombie and kept saying "services are up"."""

from __future__ import annotations

import threading

import pytest
from tpflex_trainer.demo import main as demo_main
from tpflex_trainer.demo.story import Story, StoryConfig

from tests.e2e.support import free_base_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _state(pid: int) -> str | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("State:"):
                return line.split()[1]
    except FileNotFoundError:
        return None
    return None


def test_keep_running_notices_a_killed_service_and_reaps_it(tmp_path, capsys):
    story = Story(StoryConfig(workdir=tmp_path, base_port=free_base_port()))
    story.cluster.start()
    try:
        result: list[bool] = []
        watcher = threading.Thread(target=lambda: result.append(demo_main._keep_running(story)), daemon=True)
        watcher.start()
        controller = story.cluster.procs["controller"]
        controller.kill()  # SIGKILL, as an OOM killer or an operator would
        watcher.join(30)
        assert not watcher.is_alive(), "keep-running did not notice the dead controller"
        assert result == [False]
        err = capsys.readouterr().err
        assert "controller exited with code -9" in err and "stopping the others" in err
        assert _state(controller.pid) in (None,), f"controller left as {_state(controller.pid)}"
    finally:
        story.cluster.stop()
