"""The report's ``memory.png``: per run, its measured peak per rank by role, and each rank's peak.

Each run's bar stacks the roles of the planner's one memory model (:data:`shardings.planner.memory.ROLES`):
``params``, ``compute`` (the compute-dtype copies of a precision policy), ``grads``, ``opt_state`` (held between
steps: ``metrics["memory"]``), then ``activations`` (saved for backward) and ``buffers`` (gathered parameters,
reduction buffers, workspace): the run's ``peak_parts`` (:func:`experiments.peak.parts`), which sum to its largest
measured peak. A run whose peak the planner could not split shows ``activations + buffers`` as one band (the peak
less what is held); a run without a measured peak shows its held roles and why it has no peak (e.g. ``jit=true`` on
CPU). A black marker per rank is that rank's measured peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from shardings.planner import StepMemory

__all__ = ["BANDS", "ROLES", "TRANSIENT", "draw_memory", "memory_parts"]

ROLES = StepMemory._fields  # the planner's roles, bottom to top: held ones, then activations and buffers
TRANSIENT = "activations + buffers (not told apart)"
BANDS = (*ROLES, TRANSIENT)  # bottom to top


def memory_parts(summary: dict[str, Any]) -> dict[str, float]:
    """One run's stacked parts in bytes: its ``peak_parts`` where the run split its peak, else rank 0's held roles
    and the rest of the largest measured peak as one band (none without a measured peak).

    >>> memory_parts({"memory": {"params": 4, "compute": 0, "grads": 4, "opt_state": 8, "host": 0},
    ...               "peak_memory_ranks": [30, 26]})
    {'params': 4, 'compute': 0, 'grads': 4, 'opt_state': 8, 'activations + buffers (not told apart)': 14}
    """
    if summary.get("peak_parts"):
        return {role: summary["peak_parts"][role] for role in ROLES}
    held = {role: summary["memory"][role] for role in ROLES if role in summary["memory"]}  # metrics["memory"]
    peaks = summary.get("peak_memory_ranks") or []
    return held | ({TRANSIENT: max(0, max(peaks) - sum(held.values()))} if peaks else {})


def _unmeasured(summary: dict[str, Any]) -> str:
    """The bar's label where the run measured no peak: the reason the run gave, shortened."""
    note = summary.get("peak_memory_note") or ""
    reason = note.split(": ", 1)[-1].split(" (")[0] if note else ""
    return "peak not measured" + (f"\n({reason})" if reason else "")


def draw_memory(runs: Sequence[dict[str, Any]], labels: Sequence[str], path: str | Path) -> Path:
    """``memory.png`` (module docstring)."""
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(runs)), 4.5))
    parts = [memory_parts(r["summary"]) for r in runs]
    bottom = [0.0] * len(runs)
    for name in BANDS:
        values = [p.get(name, 0) / 2**20 for p in parts]
        if any(values):
            ax.bar(range(len(runs)), values, bottom=bottom, label=name, width=0.6)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    marked = False
    for i, r in enumerate(runs):
        peaks = r["summary"].get("peak_memory_ranks") or []
        if not peaks:
            ax.annotate(_unmeasured(r["summary"]), (i, bottom[i]), ha="center", va="bottom", fontsize=7,
                        xytext=(0, 2), textcoords="offset points")
            continue
        offsets = [(k - (len(peaks) - 1) / 2) * 0.5 / len(peaks) for k in range(len(peaks))]
        ax.scatter([i + o for o in offsets], [p / 2**20 for p in peaks], marker="_", s=200, color="black",
                   linewidths=2, label=None if marked else "measured peak, one mark per rank (left: rank 0)", zorder=3)
        marked = True
    ax.set_xticks(range(len(runs)), labels, rotation=20, ha="right", rotation_mode="anchor")
    ax.set_ylabel("MiB per rank")
    ax.set_title("memory per rank at the step's peak, by role")
    ax.margins(y=0.15)  # room for the "not measured" labels
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")  # beside the bars, covering none
    fig.savefig(path, bbox_inches="tight", dpi=100)
    plt.close(fig)
    return Path(path)
