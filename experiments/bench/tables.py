"""Benchmark tables: dict rows written as CSV (shared by the bench scripts)."""

from __future__ import annotations

import csv
from pathlib import Path

__all__ = ["write_csv"]


def write_csv(path: str | Path, rows: list[dict]) -> None:
    """Write dict rows (all with the first row's keys) as a CSV table with a header.

    >>> write_csv("bench.csv", [{"pair": "dp vs DDP", "ratio": 1.0}])  # doctest: +SKIP
    """
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
