"""Benchmarks that cannot rot (issue 36 part 6): every ``bench/*.py`` with a ``__main__``
block is either run here in its ``--quick`` mode, the command a user types
(``PYTHONPATH=. .venv/bin/python bench/X.py --quick`` from the repository root), or listed
below as covered by a test that already runs it end to end, or as a helper process of
another bench. A quick run must exit 0 and print exactly one line on stdout, a JSON object
with the keys its docstring and the docs that publish its figures promise (its figures
are the quick run's; they need not meet the goals). A new bench file fails
``test_every_bench_is_run_or_listed`` until it is added to one of the tables.

The quick runs start together, ``PARALLEL`` at a time (most of them wait on etcd, gRPC
and sleeps more than they compute), in one module fixture; each bench is then its own
test case."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
PARALLEL = 3

# bench -> the keys its one JSON line must have (docstring; docs/*.md where it publishes)
QUICK: dict[str, set[str]] = {
    # its docstring (issue 40: what a job credential costs a trainer-plane call)
    "trainer_auth.py": {"calls", "off_wall_ms_per_call", "on_wall_ms_per_call", "off_cpu_ms_per_call",
                        "on_cpu_ms_per_call", "on_vs_off_cpu_ratio"},
    # docs/simulator.md "Speed"
    "sim_speed.py": {"sim_32k_15d_s", "paper_sweep_s", "planner_calls_per_s", "trace_only_s",
                     "plan_1024_nvl72_warm_ms", "plan_1024_nvl72_cold_ms"},
    # docs/agent.md
    "agent_latency.py": {"xid_to_visible_p50_ms", "xid_to_visible_p99_ms", "apply_plan_8_p99_ms",
                         "apply_plan_72_p99_ms", "etcd_put_p50_ms", "grpc_noop_p50_ms"},
    # its docstring; docs/reliability.md (the floor under controller_scale's ratio)
    "commit_floor.py": {"floor_failure_to_commit_p50_ms", "floor_failure_to_commit_p99_ms", "etcd_put_p50_ms",
                        "floor_vs_etcd_put_ratio", "watch_delivery_p50_ms", "txn_p50_ms"},
    # its docstring; issue 36's goals (commit_vs_etcd_put_ratio, full_replan_ms, p99)
    "controller_scale.py": {"failure_to_commit_p50_ms", "failure_to_commit_p99_ms", "full_replan_ms",
                            "full_replan_warm_ms", "max_txn_bytes", "etcd_put_p50_ms", "commit_vs_etcd_put_ratio",
                            "failure_to_commit_p50_ms_1pct_failed", "failure_to_commit_p99_ms_1pct_failed",
                            "prefailed_gpus", "failure_to_commit_max_ms", "failure_to_commit_max_ms_1pct_failed",
                            "failures_unreflected", "failures_unreflected_1pct_failed", "commits_not_dropping",
                            "commits_not_dropping_1pct_failed"},
    # its docstring; docs/reliability.md's abuse row
    "abuse.py": {"requests", "server_errors", "transport_errors", "rest_child_restarts", "invariant_violations",
                 "rss_peak_mb", "rest_rss_peak_mb", "decision_p99_ms_during_abuse"},
    # its docstring; docs/reliability.md's load row and issue 36
    "load.py": {"nodes", "decisions_checked", "decisions_wrong", "invariant_violations", "failure_to_commit_p99_ms",
                "failures_unreflected", "failures_superseded", "rss_after_warmup_mb", "rss_start_mb", "rss_end_mb",
                "rest_rss_start_mb", "rest_rss_end_mb", "leases_expired", "lease_renew_lag_max_s", "nodes_lost",
                "rest_cache_hit_ratio", "rest_p99_ms", "rest_offered_rps", "rest_achieved_rps",
                "rest_generator_lag_p99_ms", "rest_saturated_rps", "rest_saturated_p99_ms", "rest_on_off_s",
                "failure_to_commit_p99_ms_during_rest_load", "failure_to_commit_p99_ms_without_rest_load",
                "failure_to_commit_p99_ms_outside_rest_phases", "etcd_put_p99_ms", "rest_single_client_p99_ms"},
    # its docstring; docs/api.md and docs/reliability.md (CPU per request)
    "load_rest_cpu.py": {"nodes", "requests", "rest_cpu_ms_per_request", "rest_wall_ms_per_request",
                         "rest_cpu_ms_per_request_by_path", "rest_idle_cpu_ms_per_s"},
    # docs/ntp.md (see its docstring)
    "grad_sync.py": {"step_time_ratio", "grad_bytes_per_step", "lower_bound_bytes", "bytes_ratio",
                     "uniform_step_s", "nonuniform_step_s", "sync_wait_after_backward_s"},
    # docs/ntp.md: per case the bytes against their bound
    "reshard.py": {"cases", "max_bytes_ratio"},
    # docs/ntp.md's figures
    "hf_step.py": {"params", "dense_step_s", "uniform_step_s", "nonuniform_step_s", "step_time_ratio",
                   "grad_bytes_per_step", "grad_bytes_lower_bound", "bytes_ratio", "load_s", "export_s"},
    # docs/ntp.md's figures
    "pipeline.py": {"uniform_step_s", "one_stage_degraded_step_s", "healthy_replica_step_ratio",
                    "activation_bytes_per_step", "activation_bytes_lower_bound", "broadcast_bytes_per_step",
                    "broadcast_bytes_bound", "all_pairs_bytes", "all_pairs_ratio",
                    "uniform_activation_bytes_per_step", "uniform_activation_bytes_lower_bound",
                    "uniform_broadcast_bytes_per_step"},
    # its docstring
    "recovery.py": {"recovery_p50_s", "phases_p50_s", "regrouped_p50_s", "checkpoint_restart_p50_s",
                    "speedup_vs_checkpoint_restart"},
}

# keys inside a nested figure
NESTED: dict[tuple[str, str], set[str]] = {
    ("reshard.py", "cases"): {"from_tp", "to_tp", "bytes_moved", "lower_bound_bytes", "planned_bytes", "reshard_s",
                              "full_reload_s", "apply_plan_s", "apply_plan_phases_s"},
    ("recovery.py", "phases_p50_s"): {"detection", "plan_commit", "power_applied", "reshard", "first_step_after"},
}

# benches already run end to end by a test of their own: not run twice (their --quick
# mode is checked to exist here; the covering test runs the same sizes or the soak's)
COVERED: dict[str, str] = {
    "ui.py": "tests/ui/test_bench_ui.py::test_the_bench_runs_small_and_reports_on_one_clock "
             "(--racks 4 --failures 2 --loads 1, what --quick runs; it needs chromium)",
    "soak.py": "tests/reliability/test_soak.py::test_two_minute_soak_loses_nothing (--quick is still minutes: "
               "the soak's smallest meaningful run)",
}

# not benchmarks: processes another bench starts, each exercised by its own tests
HELPERS: dict[str, str] = {
    "lease_keeper.py": "bench/load.py's lease-renewal child (python -m bench.lease_keeper, reads its leases on "
                       "stdin); tests/reliability/test_load_leases.py and every load.py quick run",
    "rest_clients.py": "bench/load.py's REST load generator (needs --url of a server); "
                       "tests/reliability/test_rest_clients.py and every load.py quick run",
}

_MAIN = re.compile(r"^if __name__ == ['\"]__main__['\"]:", re.M)


def _benches() -> set[str]:
    return {p.name for p in BENCH.glob("*.py") if _MAIN.search(p.read_text())}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPFLEX_")}  # no planted defects
    env["PYTHONPATH"] = str(ROOT)
    return env


def _run(name: str) -> tuple[subprocess.CompletedProcess | str, float]:
    t0 = time.monotonic()
    try:
        out = subprocess.run([sys.executable, f"bench/{name}", "--quick"], cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return f"timed out after 240 s: {err[-3000:]}", time.monotonic() - t0
    return out, time.monotonic() - t0


@pytest.fixture(scope="module")
def quick_runs(request) -> dict[str, tuple]:
    """The quick runs of the benches this session's tests ask for (all, unless -k picks)."""
    wanted = {item.callspec.params["name"] for item in request.session.items
              if getattr(item, "originalname", None) == "test_quick_mode_prints_its_keys"}
    with ThreadPoolExecutor(PARALLEL) as pool:
        # the longest first, so that the short ones fill in beside them
        names = sorted(wanted, key=lambda n: (n not in ("recovery.py", "hf_step.py", "load.py", "pipeline.py"), n))
        runs = dict(zip(names, pool.map(_run, names), strict=True))
    print("quick runs (s): " + ", ".join(f"{n} {s:.1f}" for n, (_, s) in sorted(runs.items(), key=lambda r: -r[1][1])))
    return runs


def test_every_bench_is_run_or_listed():
    found = _benches()
    listed = [*QUICK, *COVERED, *HELPERS]
    assert len(listed) == len(set(listed)), "a bench is in two tables"
    assert found == set(listed), (
        f"not run nor listed: {sorted(found - set(listed))}; listed but no bench/*.py with a __main__ block: "
        f"{sorted(set(listed) - found)}")
    for name, why in {**COVERED, **HELPERS}.items():
        for test in re.findall(r"tests/[\w/]+\.py", why):
            assert (ROOT / test).is_file(), f"{name}: {test} does not exist"


@pytest.mark.parametrize("name", sorted(COVERED))
def test_a_covered_bench_has_a_quick_mode(name):
    out = subprocess.run([sys.executable, f"bench/{name}", "--help"], cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "--quick" in out.stdout, out.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(QUICK))
def test_quick_mode_prints_its_keys(name, quick_runs):
    out, seconds = quick_runs[name]
    assert not isinstance(out, str), out
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-4000:]}"
    lines = out.stdout.splitlines()
    assert len(lines) == 1, f"stdout must be one JSON line, got {len(lines)}: {out.stdout[-2000:]}"
    got = json.loads(lines[0])
    assert isinstance(got, dict)
    missing = QUICK[name] - set(got)
    assert not missing, f"{name} --quick lacks {sorted(missing)}"
    for (bench, key), keys in NESTED.items():
        if bench == name:
            for item in got[key] if isinstance(got[key], list) else [got[key]]:
                assert keys <= set(item), f"{name} {key} lacks {sorted(keys - set(item))}"
