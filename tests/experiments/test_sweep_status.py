"""A sweep keeps going: an impossible combination is skipped, a failing job recorded; the report lists every job."""

import csv
import json
import subprocess
import sys

import pytest

from experiments.report import main as report

FAST = ["runtime=simulate", "model=mlp", "steps=2", "data.max_bytes=200000", "progress=false"]


def _sweep(tmp_path, *overrides):
    sweep = tmp_path / "multirun"
    proc = subprocess.run([sys.executable, "-m", "experiments.train", "-m", *FAST, *overrides,
                           f"hydra.sweep.dir={sweep}"], capture_output=True, text=True, timeout=300)
    return sweep, proc


def _status(job_dir):
    return json.loads((job_dir / "status.json").read_text())


def test_an_impossible_combination_is_skipped_the_sweep_fails_and_the_report_lists_every_job(tmp_path, capsys):
    # zero3+tp+sp needs a tp axis that mesh=dp2 lacks: job 0 is skipped, job 1 still runs, the sweep exits 1.
    sweep, proc = _sweep(tmp_path, "layout=zero3+tp+sp,dp", "mesh=dp2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    tail = proc.stderr.splitlines()[-3:]  # the sweep's summary: the count, the job that did not run and why
    assert tail[0] == f"sweep {sweep}: 2 jobs: 1 ran, 1 skipped"
    assert tail[1].startswith("  job 0 (") and "layout=zero3+tp+sp mesh=dp2): skipped: " in tail[1]
    assert tail[2].startswith("Error: 1 of 2 jobs did not run.") and "sweep.allow_skipped=true" in tail[2]
    assert "Traceback" not in proc.stderr
    skipped = [ln for ln in proc.stderr.splitlines() if ln.startswith("skipped")]
    assert len(skipped) == 1 and "skipped job 0 (" in skipped[0] and "layout=zero3+tp+sp mesh=dp2)" in skipped[0]
    assert "needs a mesh axis tp" in skipped[0]
    assert _status(sweep / "0")["status"] == "skipped" and "needs a mesh axis tp" in _status(sweep / "0")["reason"]
    assert _status(sweep / "1") == {"status": "ran", "reason": None}

    assert report([str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "2 jobs: 1 skipped, 1 ran" in out
    assert "layout=zero3+tp+sp: skipped: layout=zero3+tp+sp mesh={'dp': 2}: " in out and "layout=dp: ran" in out
    assert "- layout=zero3+tp+sp: skipped: " in (sweep / "report.md").read_text()
    with open(sweep / "report.csv") as f:
        assert [r["run"] for r in csv.DictReader(f)] == ["layout=dp"]  # the table holds the runs


@pytest.mark.simulated  # the sweep's jobs run runtime=simulate in a child process
def test_a_failing_job_is_recorded_the_rest_run_and_the_exit_status_says_so(tmp_path, capsys):
    sweep, proc = _sweep(tmp_path, "sweep.allow_skipped=true",  # accepts skipped jobs, never failed ones
                         "layout=dp", "mesh=dp2", "data.source=/no/such/dir,stdlib")
    assert proc.returncode == 1
    assert "failed job 0 (" in proc.stderr and "data.source=/no/such/dir): ValueError" in proc.stderr
    assert "Error: data.source='/no/such/dir' is neither" in proc.stderr  # the one line, and where the rest is
    assert f"full trace: {sweep / '0' / 'error.log'}" in proc.stderr and "Traceback" not in proc.stderr
    assert "Traceback (most recent call last)" in (sweep / "0" / "error.log").read_text()
    assert proc.stderr.splitlines()[-3] == f"sweep {sweep}: 2 jobs: 1 failed, 1 ran"
    assert proc.stderr.splitlines()[-1].endswith("Fix: correct or drop them (each line above says why).")
    assert _status(sweep / "0")["status"] == "failed" and "/no/such/dir" in _status(sweep / "0")["reason"]
    assert _status(sweep / "1")["status"] == "ran"  # the sweep went on past the failure

    assert report([str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "2 jobs: 1 failed, 1 ran" in out
    assert "data.source=/no/such/dir: failed: ValueError: data.source='/no/such/dir' is neither" in out


@pytest.mark.simulated  # the sweep's jobs run runtime=simulate in a child process
def test_a_misspelled_layout_or_logical_name_in_a_sweep_is_a_skipped_job_saying_what_was_meant(tmp_path, capsys):
    # tests/experiments/axes_typo.py: mlp whose block 0 names a dim "mpl". Jobs: mlp×dp, mlp×zer03, typo×dp, typo×zer03.
    sweep, proc = _sweep(tmp_path, "sweep.allow_skipped=true", "model.name=mlp,tests.experiments.axes_typo",
                         "layout=dp,zer03", "mesh=dp2")
    assert proc.returncode == 0, proc.stderr[-3000:]  # skipped jobs accepted
    assert proc.stderr.splitlines()[-4] == f"sweep {sweep}: 4 jobs: 1 ran, 3 skipped"
    assert _status(sweep / "0") == {"status": "ran", "reason": None}
    bad = _status(sweep / "1")
    assert bad["status"] == "skipped" and "did you mean 'zero3'?" in bad["reason"] and "Fix:" in bad["reason"]
    assert "skipped job 1 (" in proc.stderr and "model.name=mlp layout=zer03 mesh=dp2): impossible" in proc.stderr
    typo = _status(sweep / "2")
    assert typo["status"] == "skipped"
    assert typo["reason"].startswith("layout=dp mesh={'dp': 2}: at ['blocks'][0]['w_up']")
    assert "unknown logical name 'mpl' (of the names ('embed', 'mpl')): did you mean 'mlp'?" in typo["reason"]
    assert "Rules([" not in typo["reason"]  # the names, not the rules table

    assert report([str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "4 jobs: 1 ran, 3 skipped" in out and "did you mean 'mlp'?" in (sweep / "report.md").read_text()
