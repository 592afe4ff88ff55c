"""``python -m experiments.report <multirun dir>... [--out DIR]``: a sweep's runs side by side.

Finds every job of the sweep under the directory (a folder Hydra gave ``.hydra/``, or one with a
``summary.json``) and its status from ``status.json``: ``ran``, ``skipped`` (an impossible
combination) or ``failed``, with why. It prints and writes (``report.md``) that list, and for the
runs (a folder with ``metrics.jsonl`` and ``summary.json``) writes, into ``--out`` (default: the
directory itself):

- ``report.md`` and ``report.csv``: one row per run — its overrides, layout, mesh, steps, final
  loss, tokens/s, compile time (``jit=true``), comm bytes per step by collective kind, memory per rank (params,
  grads, optimizer state, total); report.md also lists each job's warnings (:func:`job_warnings`);
- ``loss.png`` (loss curves overlaid, and each run's difference to the first: :func:`loss_curves`),
  ``memory.png`` (per run the measured peak by role, and each rank's: :mod:`experiments.memory_plot`),
  ``comm.png`` (comm bytes per step per run, stacked by
  collective kind on mesh axis: :func:`comm_by_axis`) and ``throughput.png`` (tokens/s per run, runs on
  simulated ranks hatched and said to be below real processes: :func:`throughput`);
- ``layout_<i>.png`` for each run that wrote ``layout.json`` (``shardings.describe_layout``): per
  parameter group and role the spec, shaded by the share of the tensor a rank holds (a colour bar says so),
  beside the step's collectives by kind × mesh axis;
- ``gantt_planned_<i>.png`` and ``gantt_measured_<i>.png`` for each run that wrote
  ``pipeline_timeline.json`` (``experiments.gantt.save``): each rank's F, B, W, sends/receives and idle time.

``<i>`` is the job's number in the sweep (its place in the job list, skipped and failed jobs counted), and every
run's label starts with ``#<i>``; a job that did not run gets a ``layout_<i>.png`` saying so.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt
import yaml
from matplotlib.ticker import MaxNLocator

from experiments import gantt
from experiments.console import WARNINGS
from experiments.memory_plot import draw_memory

__all__ = ["SIMULATED_NOTE", "collect", "comm_by_axis", "draw_layout", "job_warnings", "jobs", "loss_curves", "main",
           "throughput", "write_report"]

_MEMORY = ("params", "grads", "opt_state")
SIMULATED_NOTE = "simulated ranks (one process): below real processes, not a throughput measure"


def _overrides(run: Path) -> list[str]:
    path = run / ".hydra" / "overrides.yaml"
    lines = path.read_text().splitlines() if path.exists() else []
    return [ln.strip().removeprefix("- ").strip("'\"") for ln in lines if ln.strip()]


def _labels(runs: list[Path]) -> list[str]:
    """Each run's overrides that not every run shares (what the sweep varied), else its folder name."""
    overrides = [_overrides(r) for r in runs]
    common = set.intersection(*map(set, overrides)) if len(runs) > 1 else set()
    return [" ".join(o for o in ov if o not in common) or r.name for r, ov in zip(runs, overrides)]


def _runtime(run: str | Path) -> str | None:
    """The run's ``runtime.kind`` (``simulate``, ``multiprocess``, ``torchrun``) from its ``config.yaml``."""
    for path in (Path(run, "config.yaml"), Path(run, ".hydra", "config.yaml")):
        if path.exists():
            return (yaml.safe_load(path.read_text()) or {}).get("runtime", {}).get("kind")
    return None


def _job_order(path: Path) -> list[Any]:
    return [(0, int(s)) if s.isdigit() else (1, s) for s in path.parts]


def _status(job: Path) -> tuple[str, str | None]:
    if (job / "status.json").exists():
        found = json.loads((job / "status.json").read_text())
        return found["status"], found.get("reason")
    if (job / "summary.json").exists():
        return "ran", None  # written before jobs recorded their status
    return "failed", "no status.json: the job was killed, or is still running"


def jobs(root: str | Path) -> list[dict[str, Any]]:
    """Every job under ``root``, in Hydra's job order: label, dir, status (ran/skipped/failed) and reason.

    >>> [(j["label"], j["status"]) for j in jobs("multirun/2024-01-01/12-00-00")]  # doctest: +SKIP
    [('layout=dp mesh=dp4', 'ran'), ('layout=zero3+tp+sp mesh=dp4', 'skipped')]
    """
    root = Path(root)
    found = {p.parent.parent for p in root.rglob("overrides.yaml") if p.parent.name == ".hydra"}
    found |= {p.parent for name in ("summary.json", "status.json") for p in root.rglob(name)}
    dirs = sorted(found, key=_job_order)
    if not dirs:
        return []
    return [{"label": label, "dir": str(job), **dict(zip(("status", "reason"), _status(job)))}
            for job, label in zip(dirs, _labels(dirs))]


def collect(root: str | Path) -> list[dict[str, Any]]:
    """The runs under ``root`` (jobs that ran), in Hydra's job order: label, summary and per-step records each."""
    return [
        {**job, "summary": json.loads(Path(job["dir"], "summary.json").read_text()),
         "records": [json.loads(line) for line in Path(job["dir"], "metrics.jsonl").read_text().splitlines() if line]}
        for job in jobs(root) if job["status"] == "ran" and Path(job["dir"], "summary.json").exists()
    ]


def _job_lines(all_jobs: list[dict[str, Any]]) -> list[str]:
    """One line per job: ``ran``, ``skipped: why`` or ``failed: why``."""
    return [f"{j['label']}: {j['status']}" + (f": {j['reason']}" if j["reason"] else "") for j in all_jobs]


def _rows(runs: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    kinds = sorted({k for r in runs for k in r["summary"]["comm_bytes_by_kind"]})
    header = ["job", "run", "layout", "mesh", "steps", "final_loss", "tokens_per_s", "compile_s",
              *[f"comm_{k}" for k in kinds],
              "comm_total", *[f"mem_{m}" for m in _MEMORY], "mem_total"]
    rows = []
    for r in runs:
        s = r["summary"]
        mesh = ",".join(f"{a}={n}" for a, n in s["mesh"].items())
        comm = [round(s["comm_bytes_by_kind"].get(k, 0)) for k in kinds]
        rows.append([r.get("job", len(rows)), r["label"], s["layout"], mesh, s["steps"], round(s["final_loss"], 4),
                     round(s["tokens_per_s"], 1), "" if s.get("compile_s") is None else round(s["compile_s"], 1),
                     *comm, round(s["comm_bytes_per_step"]), *[s["memory"][m] for m in _MEMORY], s["memory_per_rank"]])
    return header, rows


def _markdown(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(f"{v:,}" if isinstance(v, int) else str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _bars(path: Path, labels: list[str], series: dict[str, list[float]], title: str) -> None:
    fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(labels)), 4))
    bottom = [0.0] * len(labels)
    for name, values in series.items():
        ax.bar(labels, [v / 2**20 for v in values], bottom=bottom, label=name)
        bottom = [b + v / 2**20 for b, v in zip(bottom, values)]
    ax.set_ylabel("MiB per rank")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")  # beside the bars, covering none
    ax.tick_params(axis="x", labelrotation=20)
    plt.setp(ax.get_xticklabels(), ha="right", rotation_mode="anchor")  # each label ends under its bar
    fig.savefig(path, bbox_inches="tight", dpi=100)
    plt.close(fig)


def comm_by_axis(runs: Sequence[dict[str, Any]]) -> dict[str, list[float]]:
    """Per ``"<kind> on <axis>"``, each run's bytes sent per rank per step (mean over its steps): ``comm.png``'s
    series. A run whose records hold no collective rows counts by kind alone (``"<kind>"``), from its summary.

    >>> comm_by_axis([{"records": [{"comm": [{"kind": "all_gather", "axis": "dp", "bytes": 8}]}]}])
    {'all_gather on dp': [8.0]}
    """
    per_run: list[dict[str, float]] = []
    for r in runs:
        records = r.get("records") or []
        found: dict[str, float] = {}
        for rec in records:
            for row in rec.get("comm", []):
                key = f"{row['kind']} on {row['axis']}"
                found[key] = found.get(key, 0.0) + row["bytes"] / len(records)
        per_run.append(found or dict(r.get("summary", {}).get("comm_bytes_by_kind", {})))
    keys = sorted({k for found in per_run for k in found})
    return {k: [found.get(k, 0.0) for found in per_run] for k in keys}


def throughput(runs: Sequence[dict[str, Any]], path: str | Path) -> list[str]:
    """``throughput.png``: tokens/s per run; runs on simulated ranks hatched, the legend says they are several times
    below real processes (:data:`SIMULATED_NOTE`). Returns the legend's entries."""
    fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(runs)), 4))
    kinds = [_runtime(r["dir"]) if "dir" in r else None for r in runs]
    legend: dict[str, Any] = {}
    for i, (r, kind) in enumerate(zip(runs, kinds)):
        simulated = kind == "simulate"
        name = SIMULATED_NOTE if simulated else f"real processes ({kind})" if kind else "runtime not recorded"
        bar = ax.bar(i, r["summary"]["tokens_per_s"], color="lightgray" if simulated else "tab:blue",
                     hatch="//" if simulated else None, edgecolor="gray")
        legend.setdefault(name, bar)
        compile_s = r["summary"].get("compile_s")
        if compile_s is not None:  # jit: the first step's compile, apart from the tokens/s
            ax.annotate(f"compile {compile_s:.1f} s", (i, r["summary"]["tokens_per_s"]), ha="center", va="bottom",
                        fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(runs)), [f"#{r.get('job', i)} {r['label']}" for i, r in enumerate(runs)], rotation=20,
                  ha="right", rotation_mode="anchor")
    ax.set_ylabel("tokens/s (after the first step)")
    ax.set_title("throughput per job")
    ax.margins(y=0.12)  # room for the compile labels
    ax.legend(legend.values(), legend.keys(), fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, bbox_inches="tight", dpi=100)
    plt.close(fig)
    return list(legend)


def _placeholder(job: dict[str, Any], path: Path) -> Path:
    """``layout_<i>.png`` of a job that did not run: its number, label, status and why."""
    fig, ax = plt.subplots(figsize=(8, 2))
    ax.text(0.5, 0.5, f"#{job['job']} {job['label']}: {job['status']}\n{job.get('reason') or ''}"[:400], ha="center",
            va="center", wrap=True, fontsize=9)
    ax.set_axis_off()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _spec_text(spec: list[Any]) -> str:
    entry = lambda e: "·" if e is None else e if isinstance(e, str) else "(" + ",".join(e) + ")"
    return " ".join(entry(e) for e in spec)


def draw_layout(view: dict[str, Any], path: str | Path) -> Path:
    """A PNG of ``shardings.describe_layout(...).to_dict()``: specs per group and role, and the collectives."""
    roles = ["params", "compute", "grads", "opt_state"]
    rows = view["rows"]
    fig, (table, bars) = plt.subplots(1, 2, figsize=(13, 1.2 + 0.32 * max(len(rows), 6)),
                                      gridspec_kw={"width_ratios": [3, 2]})
    shares = [[r["shares"][k] for k in roles] for r in rows]
    image = table.imshow(shares, cmap="Blues_r", vmin=0, vmax=1, aspect="auto")
    fig.colorbar(image, ax=table, fraction=0.04, pad=0.01, label="share one rank holds")
    for i, r in enumerate(rows):
        for j, k in enumerate(roles):
            share = r["shares"][k]
            label = _spec_text(r["specs"][k]) + ("" if share == 1 else f"  1/{round(1 / share)}")
            table.text(j, i, label, ha="center", va="center", fontsize=7, color="white" if share < 0.4 else "black")
    table.set_xticks(range(len(roles)), ["storage", "compute", "grads", "opt state"])
    pp = lambda r: "" if r.get("pp_rank", -1) == -1 else f"  [pp {'all' if r['pp_rank'] is None else r['pp_rank']}]"
    table.set_yticks(range(len(rows)), [r["group"] + pp(r) for r in rows], fontsize=7)
    table.xaxis.tick_top()
    mesh = ", ".join(f"{a}={n}" for a, n in view["mesh"].items())
    table.set_title(f"{view['layout']} on ({mesh}): spec per dim (· = not split), 1/n = share one rank holds",
                    fontsize=9)
    comm = view["comm"]
    if comm:
        labels = [f"{c['kind']}\n{c['axis']} ×{c['count']}" for c in comm]
        bars.barh(labels, [c["bytes"] / 2**20 for c in comm])
        bars.set_xlabel("MiB sent per rank per step")
        bars.invert_yaxis()
    else:
        bars.text(0.5, 0.5, "no collectives recorded", ha="center", va="center")
        bars.set_axis_off()
    bars.set_title("collectives per step", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the colour bar's label whole
    plt.close(fig)
    return Path(path)


def loss_curves(runs: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """One PNG of the runs' loss curves; below them, each run's loss minus the first run's, step by step.

    The lower panel is what a comparison of e.g. ``precision=fp32,bf16`` on one layout is about: it shows
    differences far below the curves' own scale. Runs are :func:`collect`'s (label and per-step records).

    >>> loss_curves(collect("multirun/2024-01-01/12-00-00"), "loss.png")  # doctest: +SKIP
    """
    curves = [({x["step"]: x["loss"] for x in r["records"]}, r["label"]) for r in runs]
    fig, axes = plt.subplots(2 if len(runs) > 1 else 1, 1, figsize=(10, 6 if len(runs) > 1 else 4), sharex=True,
                             squeeze=False, gridspec_kw={"height_ratios": [2, 1]} if len(runs) > 1 else None)
    colors = [axes[0, 0].plot(list(losses), list(losses.values()), label=label)[0].get_color()
              for losses, label in curves]
    axes[0, 0].set(ylabel="loss", title="training loss")
    axes[0, 0].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the curves
    (first, first_label), diff = curves[0], axes[-1, 0]
    for (losses, label), color in zip(curves[1:], colors[1:], strict=True):  # each in its colour above
        steps = [s for s in losses if s in first]
        diff.plot(steps, [losses[s] - first[s] for s in steps], label=label, color=color)
    if len(runs) > 1:
        diff.axhline(0, color="gray", linewidth=0.5)
        diff.set(ylabel="loss − the first run's")
        diff.set_title(f"difference to {first_label}", fontsize="small")
    axes[-1, 0].set(xlabel="step")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def write_report(runs: list[dict[str, Any]], out: str | Path, all_jobs: list[dict[str, Any]] = ()) -> list[Path]:
    """Write report.md, report.csv, loss.png, memory.png and comm.png into ``out``; return their paths.

    ``all_jobs`` (from :func:`jobs`): the sweep's every job with its status, listed in report.md.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs, all_jobs = _numbered(runs, list(all_jobs))
    header, rows = _rows(runs)
    with open(out / "report.csv", "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    jobs_md = "".join(f"- {line}\n" for line in _job_lines(all_jobs)) + "\n" if all_jobs else ""
    (out / "report.md").write_text(
        f"# Sweep report: {_counts(all_jobs) if all_jobs else f'{len(runs)} runs'}\n\n{jobs_md}"
        "Comm is bytes sent per rank per step (mean over steps); memory is bytes held per rank after the "
        f"last step. Tokens/s of runs on simulated ranks (one process, every rank in turn) are below real "
        "processes' (0.62× on gpt_small's 4 ranks: python -m experiments.bench.simulate) and are "
        f"no throughput measure.\n\n{_markdown(header, rows)}\n\n{_warnings_md(runs, all_jobs)}![loss](loss.png)\n\n"
        "![memory](memory.png)\n\n![comm](comm.png)\n\n![throughput](throughput.png)\n"
    )
    loss_curves(runs, out / "loss.png")
    labels = [f"#{r['job']} {r['label']}" for r in runs]
    draw_memory(runs, labels, out / "memory.png")
    _bars(out / "comm.png", labels, comm_by_axis(runs), "comm per step per rank, by collective and mesh axis")
    throughput(runs, out / "throughput.png")
    layouts = [draw_layout(json.loads(Path(r["dir"], "layout.json").read_text()), out / f"layout_{r['job']}.png")
               for r in runs if Path(r["dir"], "layout.json").exists()]
    layouts += [_placeholder(j, out / f"layout_{j['job']}.png") for j in all_jobs if j["status"] != "ran"]
    gantts = [p for r in runs for p in gantt.draw_run(r["dir"], out, r["job"])]
    names = ("report.md", "report.csv", "loss.png", "memory.png", "comm.png", "throughput.png")
    return [out / n for n in names] + layouts + gantts


def job_warnings(job_dir: str | Path) -> list[str]:
    """The warnings a job showed (its ``warnings.jsonl``: each once, ``Category: message``)."""
    file = Path(job_dir, WARNINGS)
    found = [json.loads(line) for line in file.read_text().splitlines() if line.strip()] if file.exists() else []
    return [f"{w['category']}: {w['message']}" for w in found]


def _warnings_md(runs: list[dict[str, Any]], all_jobs: list[dict[str, Any]]) -> str:
    """report.md's warnings section: per job that showed any, each warning once."""
    per_job = [(j, job_warnings(j["dir"])) for j in (all_jobs or runs)]
    lines = [f"- #{j['job']} {j['label']}: {w}" for j, found in per_job for w in found]
    return "## Warnings\n\n" + ("\n".join(lines) if lines else "none") + "\n\n"


def _numbered(runs: list[dict[str, Any]], all_jobs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict]]:
    """Runs and jobs with ``job``: the number of each in the job list (a run's place among the runs when no job list
    is given), so the table's job column and the pictures name the same job whatever did not run."""
    numbers = {j["dir"]: i for i, j in enumerate(all_jobs)}
    return ([{**r, "job": numbers.get(r.get("dir"), i)} for i, r in enumerate(runs)],
            [{**j, "job": i} for i, j in enumerate(all_jobs)])


def _counts(all_jobs: list[dict[str, Any]]) -> str:
    """``'6 jobs: 4 ran, 2 skipped'``."""
    by_status: dict[str, int] = {}
    for j in all_jobs:
        by_status[j["status"]] = by_status.get(j["status"], 0) + 1
    return f"{len(all_jobs)} jobs: " + ", ".join(f"{n} {status}" for status, n in by_status.items())


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit code (1 when the directory holds no runs)."""
    parser = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="+", help="multirun (or run) directories written by experiments.train; "
                        "several are reported together (e.g. two single runs)")
    parser.add_argument("--out", default=None, help="where to write the report (default: the first directory)")
    args = parser.parse_args(argv)
    all_jobs = [j for root in args.root for j in jobs(root)]
    runs = [r for root in args.root for r in collect(root)]
    if all_jobs:
        print(f"{_counts(all_jobs)}:\n" + "\n".join(_job_lines(all_jobs)) + "\n")
    if not runs:
        print(f"error: no runs (summary.json + metrics.jsonl) under {' '.join(args.root)}. Fix: pass the directory "
              "a `python -m experiments.train -m ...` sweep printed.", file=sys.stderr)
        return 1
    runs = _numbered(runs, all_jobs)[0]
    paths = write_report(runs, args.out or args.root[0], all_jobs)
    print(_markdown(*_rows(runs)))
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
