"""Gantt charts of a pipeline schedule: each rank's forwards, backwards (B, W), sends/receives and idle time.

Two sources, one drawing. ``planned(schedule)``: the unit-time ``timeline`` (every F, B, W one slot,
communication free), so its idle area is exactly ``schedule.bubble()``. ``measured(result.timeline)``: the
executor's timestamps (``pipeline.run`` on real ranks gathers every rank's), seconds from the first action,
sends and receives drawn too. ``save(path, schedule, result)`` writes both as ``pipeline_timeline.json`` beside a
run; ``draw_run`` (called by ``experiments.report``) turns that file into ``gantt_planned_<i>.png`` and
``gantt_measured_<i>.png``.

``python -m experiments.gantt zb_v --pp 4 --m 8 --out gantt.png`` draws a built schedule as planned.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from shardings import pipeline

__all__ = ["Bar", "draw", "draw_run", "idle_fraction", "measured", "planned", "save"]

COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868", "send": "#8c8c8c", "recv": "#c7c7c7"}
COMPUTE = ("F", "B", "W")
TIMELINE = "pipeline_timeline.json"


class Bar(NamedTuple):
    rank: int
    start: float
    end: float
    kind: str  # F, B, W, send or recv
    label: str  # e.g. "F3" (microbatch 3), with its stage where a rank runs several: "F3@5"; TeraPipe's chunk: "F3.1"


def _label(action: Any, several: bool, seq_chunks: int = 1) -> str:
    unit = f"{action.mb}" if seq_chunks == 1 else "{}.{}".format(*divmod(action.mb, seq_chunks))
    return f"{action.kind[0] if action.kind in COMPUTE else ''}{unit}" + (f"@{action.stage}" if several else "")


def planned(schedule: pipeline.Schedule) -> list[Bar]:
    """The unit-time timeline's computes as bars (sends and receives take no time there)."""
    several = schedule.stages_per_rank > 1
    return [Bar(r, t, t + 1, a.kind, _label(a, several, schedule.seq_chunks))
            for r, row in enumerate(pipeline.timeline(schedule)) for t, a in row]


def measured(timed: Sequence[Any], stages_per_rank: int = 1, seq_chunks: int = 1) -> list[Bar]:
    """``pipeline.Result.timeline`` (``Timed`` rows) as bars, seconds from the first action's start."""
    t0 = min(t.start for t in timed)
    kind = lambda a: a.kind if a.kind in COMPUTE else a.kind.split("_")[0].lower()
    return [Bar(t.rank, t.start - t0, t.end - t0, kind(t.action), _label(t.action, stages_per_rank > 1, seq_chunks))
            for t in timed]


def idle_fraction(bars: Sequence[Bar], ranks: int) -> float:
    """1 − compute time / (ranks × span): for ``planned(s)`` exactly ``s.bubble()``."""
    span = max(b.end for b in bars) - min(b.start for b in bars)
    busy = sum(b.end - b.start for b in bars if b.kind in COMPUTE)
    return 1 - busy / (ranks * span)


def draw(bars: Sequence[Bar], ranks: int, path: str | Path, title: str, unit: str = "slot") -> Path:
    """One row per rank (rank 0 on top); each bar coloured by kind and labelled when wide enough; idle is the
    white between bars. Returns ``path``."""
    span = max(b.end for b in bars)
    fig, ax = plt.subplots(figsize=(min(18, 3 + 0.32 * len(bars) / max(ranks, 1)), 0.9 + 0.55 * ranks))
    for b in bars:
        ax.barh(b.rank, b.end - b.start, left=b.start, height=0.8 if b.kind in COMPUTE else 0.35,
                color=COLORS[b.kind], edgecolor="white" if b.kind in COMPUTE else "none", linewidth=0.5)
        if b.kind in COMPUTE and (b.end - b.start) > span / 60:
            ax.text((b.start + b.end) / 2, b.rank, b.label, ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_xlabel(unit)
    ax.set_title(f"{title} — idle {idle_fraction(bars, ranks):.1%}", fontsize=9)
    kinds = [k for k in COLORS if any(b.kind == k for b in bars)]
    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in kinds], ncol=len(kinds), fontsize=7,
              loc="upper center", bbox_to_anchor=(0.5, -0.25 if ranks > 2 else -0.4), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def save(path: str | Path, schedule: pipeline.Schedule, result: pipeline.Result | None = None) -> Path:
    """Write the planned bars and (with ``result``) the measured ones as JSON, for :func:`draw_run`."""
    found = {"name": schedule.name, "pp": schedule.pp, "microbatches": schedule.microbatches,
             "seq_chunks": schedule.seq_chunks, "planned": [list(b) for b in planned(schedule)],
             "measured": [list(b) for b in measured(result.timeline, schedule.stages_per_rank, schedule.seq_chunks)]
             if result else None}
    Path(path).write_text(json.dumps(found))
    return Path(path)


def draw_run(run: str | Path, out: str | Path, index: int) -> list[Path]:
    """``gantt_planned_<index>.png`` and ``gantt_measured_<index>.png`` from ``run``'s ``pipeline_timeline.json``;
    nothing if the run has none."""
    source = Path(run) / TIMELINE
    if not source.exists():
        return []
    found = json.loads(source.read_text())
    chunks = found.get("seq_chunks", 1)
    title = f"{found['name']}: pp={found['pp']}, m={found['microbatches']}" + (f", k={chunks}" if chunks > 1 else "")
    paths = [draw([Bar(*b) for b in found["planned"]], found["pp"], Path(out) / f"gantt_planned_{index}.png",
                  f"{title}, planned (unit time)")]
    if found["measured"]:
        paths.append(draw([Bar(*b) for b in found["measured"]], found["pp"], Path(out) / f"gantt_measured_{index}.png",
                          f"{title}, measured", unit="seconds"))
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("schedule", choices=sorted(pipeline.SCHEDULES))
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--virtual-stages", type=int, default=None)
    parser.add_argument("--seq-chunks", type=int, default=1, help="TeraPipe: chunks per microbatch's sequence")
    parser.add_argument("--out", default="gantt.png")
    args = parser.parse_args(argv)
    schedule = pipeline.build(args.schedule, args.pp, args.m, virtual_stages=args.virtual_stages,
                              seq_chunks=args.seq_chunks)
    chunks = f", k={args.seq_chunks}" if args.seq_chunks > 1 else ""
    print(draw(planned(schedule), schedule.pp, args.out, f"{schedule.name}: pp={schedule.pp}, m={args.m}{chunks}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
