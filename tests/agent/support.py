"""Test support for the agent: the fake NVML state file and agent processes.

Used by tests/agent and bench/agent_latency.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.wait import wait_until  # noqa: F401  (re-exported)

ROOT = Path(__file__).resolve().parents[2]
FAKE_NVML_DIR = ROOT / "agent" / "fake_nvml" / "build"
FAKE_NVML_LIB = FAKE_NVML_DIR / "libnvidia-ml.so.1"
AGENT_BIN = Path(sys.executable).parent / "tpflex-agent"
READY = re.compile(r"tpflex-agent ready node=(\S+) backend=(\S+) grpc=(\S+):(\d+) metrics=(\S+):(\d+)")


def build_fake_nvml() -> Path:
    if not FAKE_NVML_LIB.exists():
        subprocess.run(["make", "-s", "fake-nvml"], cwd=ROOT, check=True)
    return FAKE_NVML_LIB


def _gpu_defaults(i: int) -> dict:
    return {
        "uuid": f"GPU-fake-{i:04d}", "name": "NVIDIA_H100_80GB_HBM3", "serial": f"FAKE{i:08d}",
        "power_mw": 650_000, "limit_mw": 700_000, "default_mw": 700_000, "min_mw": 200_000,
        "max_mw": 900_000, "temp": 55, "sm_mhz": 1980, "max_sm_mhz": 1980, "throttle": 4,
        "ecc_sbe": 0, "ecc_dbe": 0, "retired": 0, "remap_pending": 0, "remap_failed": 0,
        "nvlinks": 18, "nvlink_down": 0, "lost": 0, "deny_set": 0,
        "fabric_state": 0,  # no NVLink fabric (an HGX node): the fabric calls say NOT_SUPPORTED
    }


@dataclass
class FakeNvml:
    """The state file of agent/fake_nvml (format documented in fake_nvml.c)."""

    path: Path
    count: int = 2
    gpus: list[dict] = field(default_factory=list)
    events: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.gpus = [_gpu_defaults(i) for i in range(self.count)]
        self.write()

    def env(self, log_path: Path | None = None) -> dict[str, str]:
        env = {"FAKE_NVML_STATE": str(self.path), "LD_LIBRARY_PATH": str(FAKE_NVML_DIR)}
        if log_path is not None:
            env["FAKE_NVML_LOG"] = str(log_path)
        return env

    def set(self, index: int, **fields) -> FakeNvml:
        self.gpus[index].update(fields)
        return self.write()

    def xid(self, index: int, code: int, **fields) -> FakeNvml:
        self.gpus[index].update(fields)
        self.events.append(f"event {index} xid {code}")
        return self.write()

    def fabric(self, cluster_uuid: str, clique: int, state: int = 3, status: int = 0) -> FakeNvml:
        """Every GPU registered with one NVLink fabric domain (state 3 = COMPLETED)."""
        for g in self.gpus:
            g.update(fabric_uuid=cluster_uuid, fabric_clique=clique, fabric_state=state,
                     fabric_status=status)
        return self.write()

    def dbe(self, index: int) -> FakeNvml:
        self.gpus[index]["ecc_dbe"] += 1
        self.events.append(f"event {index} dbe")
        return self.write()

    def write(self) -> FakeNvml:
        lines = [
            f"gpu {i} " + " ".join(f"{k}={v}" for k, v in g.items()) for i, g in enumerate(self.gpus)
        ] + self.events
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, self.path)  # atomic: the library never sees a partial file
        return self


class AgentProcess:
    """A real ``tpflex-agent`` process; waits for its ready line."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, timeout: float = 30.0,
                 prefix: list[str] = ()) -> None:
        """``prefix``: a command that runs the agent (e.g. tests/support/seccomp_deny.py)."""
        full_env = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen(
            [*prefix, str(AGENT_BIN), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=full_env,
        )
        self.stderr_lines: list[str] = []
        self._err_thread = threading.Thread(target=self._drain_stderr, daemon=True)
        self._err_thread.start()
        line = self._ready_line(timeout)
        m = READY.search(line)
        if not m:
            self.kill()
            raise RuntimeError(f"agent did not start: {line!r}; stderr: {self.stderr()}")
        self.node, self.backend = m.group(1), m.group(2)
        self.grpc_address = f"{m.group(3)}:{m.group(4)}"
        self.metrics_port = int(m.group(6))

    def _ready_line(self, timeout: float) -> str:
        result: list[str] = []
        t = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        return result[0] if result else ""

    def _drain_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr_lines.append(line)

    def stderr(self) -> str:
        return "".join(self.stderr_lines[-40:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def terminate(self, timeout: float = 15.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def __enter__(self) -> AgentProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


