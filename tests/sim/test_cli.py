"""`tpflex-sim` CLI: outputs, progress bar, and exit 2 with a message on bad input."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
from tpflex_controller.sim.cli import main

SMALL_RUN = ["run", "--gpus", "2048", "--domain-size", "32", "--pp", "4", "--days", "3",
             "--rate-scale", "20", "--seed", "2"]


@pytest.mark.parametrize(
    ("argv", "param"),
    [
        (["run", "--rate", "-1"], "--rate"),
        (["run", "--rate", "abc"], "--rate"),
        (["run", "--rate-scale", "-2"], "--rate-scale"),
        (["run", "--gpus", "1000", "--domain-size", "72"], "--domain-size"),
        (["run", "--gpus", "3200", "--domain-size", "32", "--spares", "0", "--pp", "3"], "--pp"),
        (["run", "--spares", "-1"], "--spares"),
        (["run", "--policy", "magic"], "--policy"),
        (["run", "--preset", "nope"], "--preset"),
        (["run", "--hw-repair-days", "5,3"], "--hw-repair-days"),
        (["run", "--blast", "rack"], "--blast"),
        (["sweep", "--preset", "nope"], "--preset"),
        (["sweep", "--fractions", "0.1,x"], "--fractions"),
        (["sweep", "--fractions", "1.5"], "--fractions"),
        (["sweep", "--domain-sizes", "0"], "--domain-sizes"),
    ],
)
def test_bad_input_exits_2_naming_the_parameter(argv, param, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert param in err and "Traceback" not in err


def test_console_script_exits_2_on_bad_input():
    proc = subprocess.run(
        [sys.executable, "-m", "tpflex_controller.sim.cli", "run", "--rate", "-0.5"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and "--rate" in proc.stderr and "Traceback" not in proc.stderr


def test_run_writes_json_csv_plot_and_shows_progress(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert main([*SMALL_RUN, "--json", str(out), "--csv", str(tmp_path / "t.csv"),
                 "--plot", str(tmp_path / "t.png")]) == 0
    captured = capsys.readouterr()
    assert "100%" in captured.err and "ntp-pw" in captured.out
    data = json.loads(out.read_text())
    assert set(data["policies"]) == {"ntp-pw", "ntp", "dp-drop", "spare"}
    assert data["config"]["cluster"]["gpus"] == 2048 and data["events"] > 0
    rows = list(csv.DictReader((tmp_path / "t.csv").open()))
    assert {r["policy"] for r in rows} == set(data["policies"])
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_writes_csv_and_plot(tmp_path, capsys):
    argv = ["sweep", "--preset", "quick", "--samples", "2", "--fractions", "0.002",
            "--domain-sizes", "8", "--policy", "ntp,dp-drop", "--no-progress",
            "--csv", str(tmp_path / "s.csv"), "--plot", str(tmp_path / "s.png"),
            "--json", str(tmp_path / "s.json")]
    assert main(argv) == 0
    assert capsys.readouterr().err == ""
    rows = list(csv.DictReader((tmp_path / "s.csv").open()))
    assert {(r["policy"], r["placement"]) for r in rows} == {
        (p, pl) for p in ("ntp", "dp-drop") for pl in ("unpacked", "packed")
    }
    assert all(float(r["loss_mean"]) >= 0 for r in rows)
    assert len(json.loads((tmp_path / "s.json").read_text())) == 4
    assert (tmp_path / "s.png").stat().st_size > 1000


def test_presets_lists_the_paper_setups(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "paper-nvl32" in out and "paper-tp64" in out
