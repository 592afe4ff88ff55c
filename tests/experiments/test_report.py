"""A 2-run sweep of the train app, then experiments.report: table rows and valid PNG plots; runs of several
directories in one report."""

import csv
import json
import subprocess
import sys

import matplotlib.image
from matplotlib.figure import Figure

from experiments.memory_plot import TRANSIENT, draw_memory, memory_parts
from experiments.peak import NOT_MEASURED_JIT_CPU
from experiments.report import SIMULATED_NOTE, collect, comm_by_axis, loss_curves, main, throughput

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ROLES = ("params", "compute", "grads", "opt_state")


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
    for name in ("loss.png", "memory.png", "comm.png", "throughput.png", "layout_0.png", "layout_1.png"):
        assert (sweep / name).read_bytes()[:8] == PNG_SIGNATURE
        height, width, _ = matplotlib.image.imread(sweep / name).shape
        assert height > 100 and width > 100
    for job in ("0", "1"):
        _check_peak_parts(sweep / job)


def _check_peak_parts(run_dir) -> None:
    """The run's peak by role sums to its measured peak; each role is its source's: the held roles the step's
    metrics["memory"], the activations the planner's estimate of the run's layout (at most what the held roles leave
    of the peak), or a measured count where one is given (a pipelined rank's saved_peak), the buffers the rest."""
    from omegaconf import OmegaConf

    from experiments.build import build, optimizer
    from experiments.peak import parts
    from shardings.planner.candidates import Candidate
    from shardings.planner.estimate import estimate
    from shardings.planner.model_profile import block_period
    from shardings.planner.search import _profiles

    summary = json.loads((run_dir / "summary.json").read_text())
    split, peak, held = summary["peak_parts"], max(summary["peak_memory_ranks"]), summary["memory"]
    assert sum(split.values()) == peak and all(v >= 0 for v in split.values()), split
    assert {r: split[r] for r in ROLES} == {r: held[r] for r in ROLES}
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    setup, opt = build(cfg), optimizer(cfg.optim, cfg.steps)
    cand = Candidate(setup.layout.name, tuple(setup.mesh.shape.items()))
    est = estimate(setup.model, setup.model_cfg, cfg.data.batch_size, cand, opt,
                   _profiles(setup.model, setup.model_cfg, cand), block_period(setup.model, setup.model_cfg))
    rest = peak - sum(held[r] for r in ROLES)
    assert split["activations"] == min(rest, est.memory["activations"]) > 0
    assert split["buffers"] == rest - split["activations"]
    measured, source = parts(setup, opt, cfg.data.batch_size, held, peak, saved=1000.0)
    assert measured["activations"] == 1000 and measured["buffers"] == rest - 1000 and "measured" in source


def test_report_of_an_empty_directory_fails(tmp_path, capsys):
    assert main([str(tmp_path)]) == 1
    assert "no runs" in capsys.readouterr().err


def _fake_run(folder, precision: str, losses: list[float], runtime: str | None = None, status: str = "ran") -> None:
    """A run directory as experiments.train writes it (the parts the report reads)."""
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text(f"- precision={precision}\n- layout=zero3+tp+sp\n")
    (folder / "status.json").write_text(json.dumps({"status": status, "reason": "no tp axis" if status != "ran"
                                                    else None}))
    if status != "ran":
        return
    if runtime:
        (folder / "config.yaml").write_text(f"runtime:\n  kind: {runtime}\n")
    memory = {"params": 4, "compute": 2, "grads": 4, "opt_state": 8}
    comm = [{"kind": "all_gather", "axis": "dp", "count": 2, "bytes": 6}, {"kind": "all_gather", "axis": "tp",
                                                                            "count": 1, "bytes": 2}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": x, "comm": comm}) + "\n"
                                                  for i, x in enumerate(losses)))
    (folder / "layout.json").write_text(json.dumps({
        "layout": "zero3+tp+sp", "mesh": {"dp": 2, "tp": 2}, "comm": comm, "pipelined": False,
        "rows": [{"group": "embed", "shape": [8, 4], "count": 1, "specs": {k: ["tp", "dp"] for k in ROLES},
                  "shares": {k: 0.25 for k in ROLES}}]}))
    (folder / "summary.json").write_text(json.dumps({
        "layout": "zero3+tp+sp", "mesh": {"dp": 2, "tp": 2}, "steps": len(losses), "final_loss": losses[-1],
        "tokens_per_s": 1.0, "comm_bytes_by_kind": {"all_gather": 8.0}, "comm_bytes_per_step": 8.0,
        "memory": memory, "memory_per_rank": sum(memory.values())}))


def test_runs_of_two_directories_in_one_report_with_a_difference_panel(tmp_path):
    _fake_run(tmp_path / "fp32", "fp32", [5.5, 4.0, 3.0])
    _fake_run(tmp_path / "bf16", "bf16", [5.5, 4.01, 3.02])
    out = tmp_path / "report"
    assert main([str(tmp_path / "fp32"), str(tmp_path / "bf16"), "--out", str(out)]) == 0
    with open(out / "report.csv") as f:
        assert [r["final_loss"] for r in csv.DictReader(f)] == ["3.0", "3.02"]
    two_panels = matplotlib.image.imread(out / "loss.png").shape
    loss_curves(collect(tmp_path / "fp32"), tmp_path / "one.png")  # one run: no difference panel
    assert two_panels[0] > matplotlib.image.imread(tmp_path / "one.png").shape[0]


def test_comm_by_mesh_axis_throughput_marked_simulated_and_pictures_numbered_by_job(tmp_path):
    # jobs 0 (simulated), 1 (skipped: no run, no layout of its own), 2 (real processes)
    sweep = tmp_path / "multirun"
    _fake_run(sweep / "0", "fp32", [5.5, 4.0], runtime="simulate")
    _fake_run(sweep / "1", "bf16", [], status="skipped")
    _fake_run(sweep / "2", "fp16", [5.5, 4.2], runtime="multiprocess")
    assert main([str(sweep)]) == 0
    runs = collect(sweep)
    assert comm_by_axis(runs) == {"all_gather on dp": [6.0, 6.0], "all_gather on tp": [2.0, 2.0]}
    assert throughput(runs, tmp_path / "t.png") == [SIMULATED_NOTE, "real processes (multiprocess)"]
    assert "below real processes" in SIMULATED_NOTE and "simulated ranks" in (sweep / "report.md").read_text()
    with open(sweep / "report.csv") as f:
        assert [(r["job"], r["run"]) for r in csv.DictReader(f)] == [("0", "precision=fp32"), ("2", "precision=fp16")]
    for i in (0, 1, 2):  # the skipped job's picture says so; the third run's is layout_2, not layout_1
        assert (sweep / f"layout_{i}.png").read_bytes()[:8] == PNG_SIGNATURE
    ran = matplotlib.image.imread(sweep / "layout_2.png").shape
    assert ran[1] > matplotlib.image.imread(sweep / "layout_1.png").shape[1]  # a placeholder, not a layout


def _bands(figure) -> dict[str, list[float]]:
    """The stacked bars of ``memory.png``'s figure: per band, its height per run (MiB)."""
    (ax,) = figure.axes
    return {c.get_label(): [bar.get_height() for bar in c] for c in ax.containers}


def test_memory_png_stacks_the_peak_by_role_and_marks_each_ranks_peak(tmp_path, monkeypatch):
    held = {"params": 4 << 20, "compute": 0, "grads": 4 << 20, "opt_state": 8 << 20, "host": 0}
    split = {"params": 4 << 20, "compute": 0, "grads": 4 << 20, "opt_state": 8 << 20, "activations": 10 << 20,
             "buffers": 4 << 20}  # a run's peak_parts (experiments.peak.parts): they sum to its largest peak
    measured = {"memory": held, "peak_memory_ranks": [30 << 20, 26 << 20], "peak_parts": split}
    unsplit = {**measured, "peak_parts": None}  # the planner could not estimate it: one band for the rest
    unmeasured = {"memory": held, "peak_memory_ranks": None, "peak_memory_note": NOT_MEASURED_JIT_CPU}
    assert memory_parts(measured) == split
    assert memory_parts(unsplit) == {**{r: held[r] for r in ROLES}, TRANSIENT: 14 << 20}  # largest peak less held
    assert memory_parts(unmeasured) == {r: held[r] for r in ROLES}
    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    draw_memory([{"summary": s} for s in (measured, unsplit, unmeasured)], ["#0 a", "#1 b", "#2 c"],
                tmp_path / "memory.png")
    bands = _bands(figures[0])
    assert list(bands) == ["params", "grads", "opt_state", "activations", "buffers", TRANSIENT]  # compute: 0, none
    assert bands["activations"] == [10, 0, 0] and bands["buffers"] == [4, 0, 0] and bands[TRANSIENT] == [0, 14, 0]
    assert [sum(b[i] for b in bands.values()) for i in range(3)] == [30, 30, 16]  # the peak; held alone
    (ax,) = figures[0].axes
    marks = [p for c in ax.collections for p in c.get_offsets()[:, 1].tolist()]
    assert marks == [30.0, 26.0, 30.0, 26.0]  # one mark per rank of each measured run, in MiB
    assert [t.get_text() for t in ax.texts] == ["peak not measured\n(jit=true on CPU)"]  # the run's reason
    # where a run measures nothing, it says so (console, summary.json's peak_memory_note): jit=true on CPU
    import torch

    from experiments.peak import measures

    assert measures(False) == (True, None)
    assert measures(True) == ((True, None) if torch.cuda.is_available() else (False, NOT_MEASURED_JIT_CPU))
    legend = ax.get_legend()
    assert legend.get_bbox_to_anchor().x0 >= ax.get_window_extent().x1  # beside the axes: it covers no bar


def test_loss_ticks_are_whole_steps_and_warnings_and_compile_time_reach_the_report(tmp_path, monkeypatch):
    sweep = tmp_path / "multirun"
    _fake_run(sweep / "0", "fp32", [5.5, 4.0, 3.5])
    summary = json.loads((sweep / "0" / "summary.json").read_text())
    (sweep / "0" / "summary.json").write_text(json.dumps({**summary, "compile_s": 12.34}))
    (sweep / "0" / "warnings.jsonl").write_text(json.dumps({"category": "IdleAxisWarning",
                                                            "message": "mesh axis tp is idle"}) + "\n")
    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    loss_curves(collect(sweep), tmp_path / "loss.png")
    ticks = figures[0].axes[-1].get_xticks()
    assert all(t == int(t) for t in ticks) and len(ticks) >= 2
    monkeypatch.undo()
    assert main([str(sweep)]) == 0
    md = (sweep / "report.md").read_text()
    assert "## Warnings\n\n- #0 precision=fp32 layout=zero3+tp+sp: IdleAxisWarning: mesh axis tp is idle\n" in md
    with open(sweep / "report.csv") as f:
        assert next(csv.DictReader(f))["compile_s"] == "12.3"


def test_each_runs_difference_to_the_first_is_drawn_in_that_runs_colour(tmp_path, monkeypatch):
    sweep = tmp_path / "multirun"
    for i, losses in enumerate(([5.5, 4.0, 3.5], [5.5, 4.1, 3.4], [5.6, 4.0, 3.6])):
        _fake_run(sweep / str(i), "fp32", losses)
    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    loss_curves(collect(sweep), tmp_path / "loss.png")
    curves, diffs = ([line for line in ax.get_lines() if line.get_label() and not line.get_label().startswith("_")]
                     for ax in figures[0].axes)
    colour = {line.get_label(): line.get_color() for line in curves}
    assert len(diffs) == 2 and all(line.get_color() == colour[line.get_label()] for line in diffs), colour
