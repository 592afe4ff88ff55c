"""A 2-run sweep of the train app, then experiments.report: table rows and valid PNG plots."""

import csv
import subprocess
import sys

import matplotlib.image

from experiments.report import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_sweep_then_report(tmp_path, capsys):
    sweep = tmp_path / "multirun"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.train", "-m", "runtime=simulate", "model=mlp", "mesh=dp2", "steps=3",
         "layout=dp,zero3", "data.max_bytes=200000", "progress=false", f"hydra.sweep.dir={sweep}"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]

    assert main([str(sweep)]) == 0
    with open(sweep / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["run"], r["layout"], r["mesh"], r["steps"]) for r in rows] == [
        ("layout=dp", "dp", "dp=2", "3"), ("layout=zero3", "zero3", "dp=2", "3")]
    dp, zero3 = rows
    assert float(dp["final_loss"]) > 0 and float(dp["tokens_per_s"]) > 0
    assert int(dp["comm_all_reduce"]) > 0 and int(dp["comm_reduce_scatter"]) == 0
    assert int(zero3["comm_reduce_scatter"]) > 0
    assert int(zero3["mem_total"]) < int(dp["mem_total"])  # ZeRO-3 holds a shard of params, grads and state
    markdown = (sweep / "report.md").read_text()
    assert "| layout=dp | dp | dp=2 | 3 |" in markdown and "| layout=zero3 | zero3 | dp=2 | 3 |" in markdown
    assert "layout=zero3" in capsys.readouterr().out
    for name in ("loss.png", "memory.png", "comm.png"):
        assert (sweep / name).read_bytes()[:8] == PNG_SIGNATURE
        height, width, _ = matplotlib.image.imread(sweep / name).shape
        assert height > 100 and width > 100


def test_report_of_an_empty_directory_fails(tmp_path, capsys):
    assert main([str(tmp_path)]) == 1
    assert "no runs" in capsys.readouterr().err
