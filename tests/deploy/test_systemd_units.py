"""The systemd units verify with systemd-analyze and keep the sandbox the services need."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import httpx
import pytest

from tests.controller.controller_harness import (
    ControllerProc,
    PlanWatcher,
    put_job,
    small_cluster,
)
from tests.deploy.tools import DEPLOY, require_tool, run_tool
from tests.deploy.units import (
    exec_binary,
    stage_dropin,
    stage_with_stub_binaries,
    unit_settings,
)
from tests.support import procfs, seccomp_deny
from tests.support.wait import wait_until

SYSTEMD = DEPLOY / "systemd"
SERVICE_UNITS = sorted(SYSTEMD.glob("*.service"))
ETCD_DROPIN = SYSTEMD / "etcd.service.d"
DEBIAN_ETCD_UNIT = Path("/lib/systemd/system/etcd.service")
# Exposure score of `systemd-analyze security` (0 = locked down, 10 = unprotected).
MAX_EXPOSURE = {"tpflex-controller.service": 2.0, "tpflex-agent.service": 3.5, "etcd.service": 2.0}


def _analyze() -> str:
    return require_tool("systemd-analyze", "/usr/bin/systemd-analyze")


def _verify(unit: Path) -> str:
    """Output of `systemd-analyze verify`; it must exit 0 and say nothing to be clean."""
    result = run_tool([_analyze(), "verify", "--man=no", str(unit)], cwd=unit.parent)
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0, output
    return output


def _exposure(unit: Path) -> float:
    result = run_tool([_analyze(), "security", "--offline=yes", "--no-pager", str(unit)], cwd=unit.parent)
    match = re.search(r"Overall exposure level for \S+: ([\d.]+)", result.stdout)
    assert match, result.stdout + result.stderr
    return float(match.group(1))


def _service(unit: Path) -> dict[str, list[str]]:
    return unit_settings(unit.read_text())["Service"]


def test_the_units_exist():
    assert {u.name for u in SERVICE_UNITS} == {"tpflex-controller.service", "tpflex-agent.service"}
    assert (ETCD_DROPIN / "10-tpflex.conf").is_file()


@pytest.mark.parametrize("unit", SERVICE_UNITS, ids=lambda u: u.name)
def test_unit_verifies_without_any_warning(unit, tmp_path):
    staged = stage_with_stub_binaries(unit, tmp_path)
    assert _verify(staged) == ""


def test_the_verify_check_catches_a_misplaced_setting(tmp_path):
    """The warning check above can fail: a [Unit]-only key in [Service] is reported."""
    broken = tmp_path / "src" / "tpflex-controller.service"
    broken.parent.mkdir()
    text = (SYSTEMD / "tpflex-controller.service").read_text()
    broken.write_text(text.replace("[Service]\n", "[Service]\nStartLimitIntervalSec=30\n", 1))
    output = _verify(stage_with_stub_binaries(broken, tmp_path / "staged"))
    assert "Unknown key 'StartLimitIntervalSec' in section [Service]" in output


@pytest.mark.parametrize("unit", SERVICE_UNITS, ids=lambda u: u.name)
def test_exec_start_runs_the_console_script_and_logs_to_journald(unit):
    service = _service(unit)
    name = unit.stem
    assert service["ExecStart"] == [
        f"/opt/tpflex/venv/bin/{name} --config /etc/tpflex/{name.removeprefix('tpflex-')}.toml"
    ]
    assert not re.search(r"\b(sh|bash)\b|[>|&;]", service["ExecStart"][0])
    assert service["StandardOutput"] == ["journal"] and service["StandardError"] == ["journal"]
    assert service["Restart"] == ["on-failure"]
    assert service["EnvironmentFile"] == [f"-/etc/tpflex/{name.removeprefix('tpflex-')}.env"]
    assert exec_binary(service["ExecStart"][0]).startswith("/opt/tpflex/venv/bin/")


def test_controller_runs_unprivileged_with_no_capabilities():
    service = _service(SYSTEMD / "tpflex-controller.service")
    assert service["User"] == ["tpflex"] and service["Group"] == ["tpflex"]
    assert service["CapabilityBoundingSet"] == [""]
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "PrivateDevices", "MemoryDenyWriteExecute"):
        assert service[key] == ["yes"], key
    assert service["ProtectSystem"] == ["strict"]
    assert "ReadWritePaths" not in service  # state lives in etcd, logs in journald


def test_controller_caps_glibc_arenas_as_the_process_would():
    """The unit's malloc settings are those the controller sets itself without them
    (tpflex_controller/heap.py), and its REST child inherits it."""
    from tpflex_controller import heap

    env = [kv for line in _service(SYSTEMD / "tpflex-controller.service")["Environment"] for kv in line.split()]
    assert f"{heap.ENV}={heap.ARENA_MAX}" in env
    assert f"{heap.MMAP_ENV}={heap.MMAP_THRESHOLD}" in env


def test_agent_is_root_with_only_the_nvml_capability_and_nvidia_devices():
    service = _service(SYSTEMD / "tpflex-agent.service")
    assert "User" not in service  # root: NVML set calls need CAP_SYS_ADMIN
    assert service["CapabilityBoundingSet"] == ["CAP_SYS_ADMIN"]
    assert service["DevicePolicy"] == ["closed"]
    assert service["DeviceAllow"] == ["char-nvidia* rw"]
    assert "PrivateDevices" not in service  # it would hide /dev/nvidia*
    assert service["ProtectSystem"] == ["strict"] and service["NoNewPrivileges"] == ["yes"]


@pytest.mark.parametrize("unit", SERVICE_UNITS, ids=lambda u: u.name)
def test_sandbox_exposure_stays_low(unit, tmp_path):
    staged = stage_with_stub_binaries(unit, tmp_path)
    assert _exposure(staged) <= MAX_EXPOSURE[unit.name]


def _staged_etcd(dest: Path) -> Path:
    if not DEBIAN_ETCD_UNIT.exists():
        pytest.skip("Debian's etcd-server unit /lib/systemd/system/etcd.service not installed")
    return stage_dropin(DEBIAN_ETCD_UNIT, ETCD_DROPIN, dest)


def test_etcd_dropin_verifies_on_the_packaged_unit(tmp_path):
    assert _verify(_staged_etcd(tmp_path)) == ""


def test_etcd_dropin_is_applied_and_hardens_the_packaged_unit(tmp_path):
    bare = tmp_path / "bare" / "etcd.service"
    bare.parent.mkdir()
    bare.write_text(DEBIAN_ETCD_UNIT.read_text() if DEBIAN_ETCD_UNIT.exists() else "")
    with_dropin = _staged_etcd(tmp_path / "dropin")
    assert _exposure(with_dropin) <= MAX_EXPOSURE["etcd.service"] < _exposure(bare)
    dropin = unit_settings((ETCD_DROPIN / "10-tpflex.conf").read_text())["Service"]
    assert dropin["EnvironmentFile"] == ["/etc/tpflex/etcd.env"]
    assert dropin["ReadWritePaths"] == ["/var/lib/etcd"]


def test_sysusers_creates_the_user_the_controller_runs_as(tmp_path):
    sysusers = require_tool("systemd-sysusers", "/usr/bin/systemd-sysusers")
    (tmp_path / "etc").mkdir()
    conf = (DEPLOY / "sysusers.d" / "tpflex.conf").resolve()
    result = run_tool([sysusers, f"--root={tmp_path}", str(conf)])
    assert result.returncode == 0, result.stderr
    users = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc" / "passwd").read_text().splitlines()}
    user = _service(SYSTEMD / "tpflex-controller.service")["User"][0]
    assert users[user][6] == "/usr/sbin/nologin" and int(users[user][2]) < 1000  # system user


def _group(name: str, seen: set[str] | None = None) -> set[str]:
    """The system calls of a ``@group`` as this systemd defines it (nested groups too)."""
    seen = set() if seen is None else seen
    seen.add(name)
    out = run_tool([_analyze(), "syscall-filter", "--no-pager", name], cwd=DEPLOY)
    assert out.returncode == 0, out.stderr
    calls: set[str] = set()
    for line in out.stdout.splitlines()[1:]:
        item = line.strip()
        if not item or item.startswith("#"):
            continue
        if item.startswith("@"):
            if item not in seen:
                calls |= _group(item, seen)
        else:
            calls.add(item)
    return calls


def _allowed_syscalls(lines: list[str]) -> set[str]:
    """The effective allow list of SystemCallFilter= lines (systemd.exec: the first line
    sets the kind; with an allow list first, a later ``~`` line removes its calls and a
    later plain line adds them back, in order)."""
    assert lines and not lines[0].startswith("~"), "the unit's filter starts with an allow list"
    allowed: set[str] = set()
    for line in lines:
        deny = line.startswith("~")
        names: set[str] = set()
        for item in line.lstrip("~").split():
            names |= _group(item) if item.startswith("@") else {item}
        allowed = allowed - names if deny else allowed | names
    return allowed


def test_the_controllers_syscall_filter_lets_its_rest_child_apply_nice_and_cpus():
    """rest.nice (default 10) calls setpriority and rest.cpus sched_setaffinity in the REST
    child; @resources, which the unit denies, holds both: without the unit's allow line
    after it, the child of a default configuration got EPERM at start."""
    allowed = _allowed_syscalls(_service(SYSTEMD / "tpflex-controller.service")["SystemCallFilter"])
    assert {"setpriority", "sched_setaffinity", "prctl", "execve", "clone"} <= allowed
    # only those two come back: the rest of @resources and all of @privileged stay denied
    assert (_group("@resources") - {"setpriority", "sched_setaffinity"}).isdisjoint(allowed)
    assert _group("@privileged").isdisjoint(allowed)


@pytest.mark.skipif(not seccomp_deny.supported(), reason="needs x86-64 Linux and asm/unistd_64.h")
def test_the_controller_works_under_its_units_syscall_filter(etcd_server, etcd, tmp_path):
    """A real tpflex-controller (and its REST child) under the unit's system-call filter,
    as the kernel enforces it (seccomp, EPERM for every call outside the unit's effective
    allow list): it is elected, commits a plan, serves REST, and applies rest.nice and
    rest.cpus, with no warning and no restart. The filter denied setpriority before: this
    is the test that catches such a call."""
    prefix = _deny_prefix("tpflex-controller.service", tmp_path)
    denied = Path(prefix[2][1:]).read_text().split()
    assert "setuid" in denied and "read" not in denied
    cpu = max(os.sched_getaffinity(0))
    racks = small_cluster(etcd)
    put_job(etcd, racks)
    watcher = PlanWatcher(etcd, "job1")
    proc = ControllerProc(etcd_server.endpoints, "c1", tmp_path, env={"TPFLEX_REST__CPUS": str(cpu)},
                          prefix=prefix)
    try:
        proc.wait_http()
        assert watcher.wait_generation(1, timeout=30).replicas
        with httpx.Client(base_url=proc.rest_url, timeout=10) as http:
            wait_until(lambda: http.get("/v1/jobs/job1/plan").status_code == 200, 15, "REST serves the plan")
        [child] = proc.rest_pids()
        child_status = procfs.status(child)
        assert child_status["Seccomp"] == "2"  # the filter is on the child too
        assert child_status["Cpus_allowed_list"] == str(cpu)
        assert procfs.nice(child) == min(19, procfs.nice(proc.proc.pid) + 10)  # rest.nice's default
        log = proc.log_path.read_text()
        assert "not applied" not in log and "Traceback" not in log, log[-3000:]
    finally:
        proc.kill()
        watcher.close()


def _deny_prefix(unit: str, tmp_path: Path) -> list[str]:
    """A command prefix that runs a program under ``unit``'s system-call filter."""
    allowed = _allowed_syscalls(_service(SYSTEMD / unit)["SystemCallFilter"])
    names = tmp_path / f"{unit}.denied"
    names.write_text("\n".join(sorted(set(seccomp_deny.syscall_numbers()) - allowed)))
    return [sys.executable, seccomp_deny.__file__, f"@{names}", "--"]


@pytest.mark.skipif(not seccomp_deny.supported(), reason="needs x86-64 Linux and asm/unistd_64.h")
def test_the_agent_works_under_its_units_syscall_filter(etcd_server, etcd, tmp_path):
    """A real tpflex-agent on the NVML backend (the fake libnvidia-ml.so, loaded as the real
    one is) under its unit's system-call filter: registers, applies the desired caps at
    start and a cap over gRPC, and revokes its lease on SIGTERM."""
    import grpc
    from tpflex_proto import agent_pb2, agent_pb2_grpc, codec, keys, types_pb2

    from tests.agent.support import AgentProcess, FakeNvml, build_fake_nvml

    build_fake_nvml()
    fake = FakeNvml(tmp_path / "nvml.state", count=2)
    desired = types_pb2.NodePowerPlan(node="s1", generation=3)
    desired.caps.add(gpu=types_pb2.GpuRef(node="s1", index=1), cap_w=600.0)
    etcd.put(keys.power("s1"), codec.encode(desired))
    args = ["--node", "s1", "--rack", "r1", "--etcd", ",".join(etcd_server.endpoints), "--listen", "127.0.0.1:0",
            "--insecure", "--metrics-listen", "127.0.0.1:0", "--backend", "nvml", "--lease-ttl-s", "30"]
    with AgentProcess(args, env=fake.env(tmp_path / "nvml.log"), prefix=_deny_prefix("tpflex-agent.service", tmp_path)) as a, \
            grpc.insecure_channel(a.grpc_address) as ch:
        assert procfs.status(a.proc.pid)["Seccomp"] == "2"
        wait_until(lambda: etcd.get(keys.node("s1")), 10, "s1 registered")
        stub = agent_pb2_grpc.AgentStub(ch)
        limits = lambda: [g.power_limit_w for g in stub.GetDevices(agent_pb2.GetDevicesRequest(), timeout=5).gpus]  # noqa: E731
        wait_until(lambda: limits()[1] == 600.0, 10, "the desired cap applied at start")
        req = agent_pb2.ApplyPowerPlanRequest(generation=4)
        req.caps.add(gpu=types_pb2.GpuRef(node="s1", index=0), cap_w=650.0)
        etcd.put(keys.power("s1"), codec.encode(types_pb2.NodePowerPlan(node="s1", generation=4, caps=req.caps)))
        reply = stub.ApplyPowerPlan(req, timeout=10)  # as the controller pushes it
        assert reply.outcome in (agent_pb2.ApplyPowerPlanResponse.APPLIED,
                                 agent_pb2.ApplyPowerPlanResponse.ALREADY_APPLIED), reply
        assert limits() == [650.0, 700.0]
        assert a.terminate() == 0, a.stderr()
        assert etcd.get(keys.node("s1")) is None and "lease revoked" in a.stderr()
        assert "Traceback" not in a.stderr()
