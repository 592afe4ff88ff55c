"""The drill table: CSV and Markdown, one row per drill."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

from experiments.drill.harness import Result

__all__ = ["COLUMNS", "markdown", "write"]

COLUMNS = ("fault", "layout", "rank", "when", "exit_s", "error", "resumed_from", "steps_lost", "equal", "ok")


def _cell(value: object) -> str:
    return "-" if value is None else str(value).replace("|", "\\|")


def markdown(results: Sequence[Result]) -> str:
    """A Markdown table of ``results`` (the columns of :data:`COLUMNS`)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r.row()[c]) for c in COLUMNS) + " |" for r in results]
    return "\n".join(lines) + "\n"


def write(results: Sequence[Result], folder: Path) -> tuple[Path, Path]:
    """Write ``drills.csv`` (every field, the problem of a failed drill included) and ``drills.md`` to ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    csv_file, md_file = folder / "drills.csv", folder / "drills.md"
    with open(csv_file, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*COLUMNS, "problem"])
        writer.writeheader()
        writer.writerows({c: r.row()[c] for c in writer.fieldnames} for r in results)
    md_file.write_text(markdown(results))
    return csv_file, md_file
