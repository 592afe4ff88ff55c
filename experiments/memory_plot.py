"""The report's ``memory.png``: per run, the bytes a rank holds by role and its measured peak per rank.

Each run's bar stacks what a rank holds through the step — ``params``, ``compute`` (the compute-dtype copies of a
precision policy), ``grads``, ``opt_state`` (``metrics["memory"]``, the step's one memory model) — and on top
``activations + buffers``: the measured peak (``experiments.peak``, the last step's) minus what is held, i.e. the
activations saved for backward and the step's temporary buffers (gathered parameters, reduction buffers,
workspace), which the measurement cannot tell apart. A black marker per rank is that rank's measured peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

__all__ = ["HELD", "TRANSIENT", "draw_memory", "memory_parts"]

HELD = ("params", "compute", "grads", "opt_state")
TRANSIENT = "activations + buffers (measured peak − held)"


def memory_parts(summary: dict[str, Any]) -> dict[str, float]:
    """One run's stacked parts in bytes (rank 0's held roles; the rest of the largest measured peak).

    >>> memory_parts({"memory": {"params": 4, "grads": 4, "opt_state": 8}, "peak_memory_ranks": [30, 26]})
    {'params': 4, 'compute': 0, 'grads': 4, 'opt_state': 8, 'activations + buffers (measured peak − held)': 14}
    """
    held = {role: summary["memory"].get(role, 0) for role in HELD}
    peaks = summary.get("peak_memory_ranks") or []
    return held | ({TRANSIENT: max(0, max(peaks) - sum(held.values()))} if peaks else {})


def draw_memory(runs: Sequence[dict[str, Any]], labels: Sequence[str], path: str | Path) -> Path:
    """``memory.png`` (module docstring); runs without a measured peak show their held roles only."""
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(runs)), 4.5))
    parts = [memory_parts(r["summary"]) for r in runs]
    bottom = [0.0] * len(runs)
    for name in [*HELD, TRANSIENT]:
        values = [p.get(name, 0) / 2**20 for p in parts]
        if any(values):
            ax.bar(range(len(runs)), values, bottom=bottom, label=name, width=0.6)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    marked = False
    for i, r in enumerate(runs):
        peaks = r["summary"].get("peak_memory_ranks") or []
        if not peaks:
            ax.annotate("peak not measured", (i, bottom[i]), ha="center", va="bottom", fontsize=7,
                        xytext=(0, 2), textcoords="offset points")
            continue
        offsets = [(k - (len(peaks) - 1) / 2) * 0.5 / len(peaks) for k in range(len(peaks))]
        ax.scatter([i + o for o in offsets], [p / 2**20 for p in peaks], marker="_", s=200, color="black",
                   linewidths=2, label=None if marked else "measured peak, one mark per rank (left: rank 0)", zorder=3)
        marked = True
    ax.set_xticks(range(len(runs)), labels, rotation=20, ha="right", rotation_mode="anchor")
    ax.set_ylabel("MiB per rank")
    ax.set_title("memory per rank: held by role, and the step's measured peak")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")  # beside the bars, covering none
    fig.savefig(path, bbox_inches="tight", dpi=100)
    plt.close(fig)
    return Path(path)
