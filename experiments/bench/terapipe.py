"""TeraPipe measured: the bubble planned against measured for k sequence chunks at fixed microbatches, 4 real ranks.

``python -m experiments.bench.terapipe [--ks 1 2 4 8] [--m 2] [--schedule gpipe] [--rows 4] [--seq 256]
[--steps 3] [--rule terapipe] [--gantt DIR]``

On ``models.gpt`` (8 blocks, 2 per stage at pp=4; ``--seq`` tokens per row) with ``--m`` microbatches of
``--rows`` rows, one ``shardings.launch`` of 4 gloo processes runs ``pipeline.run`` for each ``k`` (chunk sizes
by ``--rule``, the plan's :class:`~shardings.pipeline.SeqChunks` with the model's cost model): per rank the idle
fraction ``Result.bubble()`` from its F/B timestamps (median over ``--steps`` runs after one warm-up), their mean,
the unit-time ``schedule.bubble()`` = (p−1)/(m·k+p−1), the most bytes of activations a rank saved at once
(``saved_peak``, rank 0) and the chunks it holds at once by the plan (``peak_in_flight``, rank 0, in chunks of
``1/k`` of a microbatch). ``--gantt DIR`` writes each k's planned and measured Gantt charts there.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch.distributed as dist

import core
import models.gpt as gpt
import shardings
from shardings import Mesh, default_token_count, pipeline

PP = 4
CONFIG = dict(vocab=256, dim=128, layers=8, heads=4, kv_heads=2, mlp=256)


def _inputs(cfg: gpt.Config, plan: pipeline.Plan, m: int, rows: int) -> tuple[list[Any], list[float]]:
    batch = gpt.example_batch(cfg, m * rows)
    total = default_token_count(batch)
    mbs = [core.tree.map(lambda x, i=i: x.chunk(m)[i].clone(), batch) for i in range(m)]
    units = [c for mb in mbs for c in pipeline.cut(mb, plan.chunk_sizes(cfg.seq_len))]
    return units, [float(default_token_count(u) / total) for u in units]


def _worker(ks: list[int], m: int, rows: int, seq: int, steps: int, schedule: str, rule: str) -> dict:
    cfg = gpt.Config(**CONFIG, seq_len=seq)
    params, mesh = gpt.init(core.random.key(0), cfg), Mesh(pp=PP)
    out = {}
    for k in ks:
        plan = pipeline.plan("pp", mesh, params, schedule=schedule, microbatches=m, seq_chunks=k, chunk_sizes=rule,
                             seq_len=seq)
        units, weights = _inputs(cfg, plan, m, rows)
        runs = []
        for _ in range(1 + steps):  # the first is warm-up
            dist.barrier()
            result = pipeline.run(plan.schedule, gpt.stages(cfg), plan.split, params, units, weights, mesh=mesh)
            runs.append(result)
        per_rank = [statistics.median(r.bubble()[q] for r in runs[1:]) for q in range(PP)]
        out[k] = dict(sizes=plan.chunk_sizes(seq), per_rank=per_rank, planned=plan.schedule.bubble(),
                      saved_peak=runs[-1].saved_peak[0], in_flight=plan.schedule.peak_in_flight()[0],
                      timeline=runs[-1].timeline, schedule=plan.schedule)
    return out


def measure(ks: list[int], m: int, rows: int, seq: int, steps: int, schedule: str, rule: str,
            gantt: str | None = None) -> list[dict]:
    measured = shardings.launch(_worker, PP, ks, m, rows, seq, steps, schedule, rule)[0]  # every rank gathers all
    rows_out = []
    for k, r in measured.items():
        if gantt:
            from experiments import gantt as charts

            Path(gantt).mkdir(parents=True, exist_ok=True)
            title = f"{schedule}: pp={PP}, m={m}, k={k}"
            s = r["schedule"]
            stem = Path(gantt) / f"terapipe_{schedule}_k{k}"
            charts.draw(charts.planned(s), PP, f"{stem}_planned.png", f"{title}, planned (unit time)")
            charts.draw(charts.measured(r["timeline"], 1, k), PP, f"{stem}_measured.png", f"{title}, measured",
                        unit="seconds")
        rows_out.append({"k": k, "sizes": "/".join(map(str, r["sizes"])),
                         **{f"rank{q}": round(b, 3) for q, b in enumerate(r["per_rank"])},
                         "measured": round(statistics.mean(r["per_rank"]), 3), "planned": round(r["planned"], 3),
                         "stage0_saved_MiB": round(r["saved_peak"] / 2**20, 2), "stage0_chunks_held": r["in_flight"]})
    return rows_out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--m", type=int, default=2)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--schedule", default="gpipe", choices=["gpipe", "1f1b"])
    parser.add_argument("--rule", default="terapipe", choices=["terapipe", "equal"])
    parser.add_argument("--gantt", default=None, help="write each k's planned and measured Gantt charts here")
    args = parser.parse_args(argv)
    rows = measure(args.ks, args.m, args.rows, args.seq, args.steps, args.schedule, args.rule, args.gantt)
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[key]) for key in keys) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
