"""A sweep's end: which jobs ran, which did not and why, and an exit status that says so.

Every job of a sweep runs (a failed or impossible one is recorded in its ``status.json`` and the sweep goes
on); then :class:`SweepSummary` (a Hydra callback the train app installs) prints one line per job that did
not run and exits 1 when any failed or was skipped, so a sweep in CI is red with jobs missing.
``sweep.allow_skipped=true`` accepts skipped jobs (impossible combinations of a grid); a failed job always
makes the exit nonzero.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

__all__ = ["SWEEP_SUMMARY", "SweepSummary", "job_statuses", "summarize"]

SWEEP_SUMMARY = "++hydra.callbacks.sweep_summary._target_=experiments.sweep.SweepSummary"  # main()'s override


def job_statuses(sweep_dir: str | Path) -> list[tuple[str, str, dict[str, Any]]]:
    """``(job number, its overrides, status.json)`` of each job folder under ``sweep_dir``, in job order (a job
    without a status: ``{"status": "missing"}``)."""
    jobs = sorted((p for p in Path(sweep_dir).iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    out = []
    for job in jobs:
        overrides_file = job / ".hydra" / "overrides.yaml"
        overrides = " ".join(ln.removeprefix("- ").strip() for ln in overrides_file.read_text().splitlines()
                             if ln.strip()) if overrides_file.exists() else ""
        status_file = job / "status.json"
        status = json.loads(status_file.read_text()) if status_file.exists() else {"status": "missing", "reason":
                                                                                    "no status.json: it never ended"}
        out.append((job.name, overrides, status))
    return out


def summarize(sweep_dir: str | Path, allow_skipped: bool = False) -> tuple[list[str], int]:
    """The summary's lines and the sweep's exit status (0, or 1 when a job failed, or was skipped and
    ``allow_skipped`` is false)."""
    jobs = job_statuses(sweep_dir)
    counts: dict[str, int] = {}
    for _, _, status in jobs:
        counts[status["status"]] = counts.get(status["status"], 0) + 1
    lines = [f"sweep {sweep_dir}: {len(jobs)} jobs: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))]
    lines += [f"  job {num} ({overrides}): {status['status']}: {(status.get('reason') or '').splitlines()[0]}"
              for num, overrides, status in jobs if status["status"] != "ran" and status.get("reason")]
    bad = sum(n for s, n in counts.items() if s != "ran" and not (s == "skipped" and allow_skipped))
    if bad:
        accept = (", or pass sweep.allow_skipped=true to accept the skipped ones (impossible combinations)"
                  if counts.get("skipped") and not allow_skipped else "")
        lines.append(f"Error: {bad} of {len(jobs)} jobs did not run. Fix: correct or drop them (each line above says "
                     f"why){accept}.")
    return lines, int(bool(bad))


class SweepSummary(Callback):
    """At a multirun's end: print :func:`summarize`'s lines and exit with its status when nonzero."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        allow = bool(config.get("sweep", {}).get("allow_skipped", False))
        lines, status = summarize(config.hydra.sweep.dir, allow)
        print("\n".join(lines), file=sys.stderr, flush=True)
        if status:
            sys.exit(status)
