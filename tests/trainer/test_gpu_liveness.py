"""On a machine with a CUDA GPU: the NCCL side of issue 13's recovery with one rank.

A collective hung on the GPU (an NCCL receive nobody sends to) is caught by the hooks'
watchdog well before the collective timeout; its abort (the same ``abort_groups`` the
plan stream's restart epoch calls) ends the blocked wait without ending the process
(TORCH_NCCL_ASYNC_ERROR_HANDLING=2), and a new process group works afterwards.

Runnable with a Python holding torch, grpcio and pytest (nothing generated is needed),
from the repository root, in about a minute:
``PYTHONPATH=trainer_hooks:proto python3 -m pytest -c tests/pytest.ini -m gpu -s tests/trainer/test_gpu_liveness.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for the nccl backend"),
]

CHILD = Path(__file__).parent / "nccl_abort_child.py"


@pytest.mark.timeout(150)
def test_the_watchdog_aborts_a_hung_nccl_collective_and_the_rank_goes_on():
    env = {**os.environ, "WATCHDOG_S": "3", "PYTHONUNBUFFERED": "1"}
    env.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)  # the child sets it as the hooks do
    proc = subprocess.run([sys.executable, str(CHILD)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    print(got)
    assert got["fired"] == 1 and got["async_error_handling"] == "2"
    assert 3.0 <= got["unblocked_s"] < got["collective_timeout_s"] / 2, got
    assert got["after_reinit"] == [2.0] * 4
