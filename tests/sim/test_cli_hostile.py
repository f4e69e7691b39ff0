"""`tpflex-sim` on hostile input, as the console script in a process: exit 2 with the
option named on one line, no traceback, refused before any simulation (nothing
written). The process runs under a 4 GB address-space limit so that a regression cannot
take the machine's memory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.refusal import refused

SIM = str(Path(sys.executable).parent / "tpflex-sim")
S = ["--gpus", "256", "--domain-size", "32", "--pp", "8", "--spares", "0"]


def _refused(*args: str) -> str:
    return refused([SIM, *args], timeout=60)  # the old code ran these for minutes or without end


@pytest.mark.parametrize("cmd", [["run", *S, "--days", "1"], ["sweep", "--preset", "quick", "--samples", "1"]])
def test_plot_with_an_unknown_extension_is_refused_before_the_run(cmd, tmp_path):
    err = _refused(*cmd, "--no-progress", "--plot", str(tmp_path / "p.txt"), "--json", str(tmp_path / "r.json"))
    assert "--plot" in err and ".txt" in err and ".png" in err
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


@pytest.mark.parametrize("value", ["1,nan", "1,inf", "nan,1"])
def test_hw_repair_days_must_be_finite(value, tmp_path):
    err = _refused("run", *S, "--days", "1", "--no-progress", "--hw-repair-days", value,
                   "--json", str(tmp_path / "r.json"))
    assert "--hw-repair-days" in err and not list(tmp_path.iterdir())


@pytest.mark.parametrize("value", ["1e-310", "5e-324"])
def test_subnormal_fraction_is_refused(value):
    err = _refused("sweep", "--preset", "quick", "--samples", "1", "--no-progress", "--fractions", value)
    assert "--fractions" in err


@pytest.mark.parametrize("option", ["--domain-sizes", "--fractions"])
def test_empty_sweep_lists_are_refused(option, tmp_path):
    err = _refused("sweep", "--preset", "quick", "--samples", "1", "--no-progress", option, "",
                   "--plot", str(tmp_path / "e.png"))
    assert option in err and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["run", "--gpus", "3200000000", "--days", "0.01"], "--gpus"),
        (["run", "--gpus", "320000000000000000000"], "--gpus"),
        (["sweep", "--preset", "quick", "--gpus", "100000000000", "--domain-sizes", "8"], "--gpus"),
        (["sweep", "--preset", "quick", "--domain-sizes", "100000000"], "--domain-sizes"),
        (["run", *S, "--days", "1e9"], "--days"),
        (["run", *S, "--days", "1", "--warmup-days", "1e9"], "--warmup-days"),
        (["run", *S, "--days", "1", "--rate", "1e6"], "--rate"),
        (["run", *S, "--days", "1", "--rate-scale", "1e200"], "--rate-scale"),
        (["run", "--gpus", "1048576", "--domain-size", "32", "--rate-scale", "100", "--days", "3650"],
         "--rate-scale"),
        (["sweep", "--preset", "quick", "--samples", "1000000000"], "--samples"),
    ],
)
def test_sizes_beyond_any_real_study_are_refused(args, option):
    err = _refused(*args, "--no-progress")
    assert f"error: {option}" in err or f"/{option}" in err or f"{option}/" in err, err
