"""Predicted vs measured step time: the planner's ranking against real gloo processes on this machine.

``python -m experiments.bench.plan`` (also ``python -m experiments.plan validate``) plans ``gpt_small`` on 4
ranks with the cluster ``this`` (``experiments/conf/cluster/this.yaml``, from ``python -m experiments.plan
calibrate``), then runs each of a fixed set of layouts (pipelined ones included) on 4 gloo processes, in rounds,
the order shuffled each round so the machine's load falls on all alike. It prints, per layout, the predicted and
the median measured step time (and their spread over rounds), Kendall's τ between the two orders, and how far
the planner's first choice is from the fastest measured. A benchmark, not a test: it times things.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import random
import statistics
import time
from typing import Any

import torch.distributed as dist

import core
import models
import shardings
from shardings.planner import Candidate, Cluster, plan

__all__ = ["CANDIDATES", "kendall_tau", "main", "measure_step", "validate"]

_GPT_SMALL = dict(dim=128, layers=4, heads=8, kv_heads=4, mlp=384, seq_len=128)  # experiments' gpt_small
CANDIDATES = [  # (layout, mesh, microbatches, schedule): data, tensor, pipeline layouts on 4 ranks
    ("dp", {"dp": 4}, 1, None),
    ("zero1", {"dp": 4}, 1, None),
    ("zero2", {"dp": 4}, 1, None),
    ("zero3", {"dp": 4}, 1, None),
    ("hsdp", {"dp": 2, "fsdp": 2}, 1, None),
    ("tp", {"tp": 4}, 1, None),
    ("zero3+tp", {"dp": 2, "tp": 2}, 1, None),
    ("dp+tp+sp", {"dp": 2, "tp": 2}, 1, None),
    ("dp+pp", {"pp": 2, "dp": 2}, 4, "1f1b"),
    ("pp", {"pp": 4}, 8, "1f1b"),
    ("zero1+pp", {"pp": 2, "dp": 2}, 4, "gpipe"),
]


def candidates() -> list[Candidate]:
    """:data:`CANDIDATES` as planner candidates (fp32, no remat)."""
    return [Candidate(layout, tuple(mesh.items()), m, schedule) for layout, mesh, m, schedule in CANDIDATES]


def _step_times(cand: Candidate, cfg_kw: dict, rows: int, steps: int, warmup: int) -> list[tuple[float, float]]:
    """On each rank: ``(wall, cpu)`` seconds of ``steps`` steps of ``cand`` after ``warmup`` (what
    ``experiments.train`` runs: donated, no comm counting), each from a barrier to the next: the wall clock, and this
    process's CPU time (all its threads)."""
    cfg = models.gpt.Config(**cfg_kw)
    mesh = shardings.Mesh(cand.sizes)
    layout = shardings.layouts.get(cand.layout)
    loss = models.gpt.stages(cfg) if layout.pipelined else functools.partial(models.gpt.loss, cfg=cfg)
    params = shardings.init(models.gpt.init, core.random.key(0), cfg, axes=models.gpt.axes(cfg), layout=layout,
                            mesh=mesh, **({"schedule": cand.schedule} if cand.pipelined else {}))
    pipe = shardings.pipeline.plan_for(layout, mesh, params, schedule=cand.schedule, microbatches=cand.microbatches)
    step = shardings.train_step(loss, core.optim.adamw(1e-3), layout=layout, mesh=mesh, count_comms=False,
                                donate=True, scalar_metrics=False, accum_steps=cand.microbatches, plan=pipe)
    state = [params, step.init(params)]
    batch = models.gpt.example_batch(cfg, rows)
    times = []
    for _ in range(warmup + steps):
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        state[0], state[1], _ = step(state[0], state[1], batch)
        dist.barrier()
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    return times[warmup:]


def measure_step(cand: Candidate, cfg_kw: dict, rows: int, steps: int = 5, warmup: int = 2,
                 cores: float | None = None) -> float | tuple[float, float]:
    """The median step time of ``cand`` on real gloo processes: the wall clock (the slowest rank's per step); with
    ``cores``, also the ranks' CPU time summed and shared over that many cores (what the step would take on a
    machine running nothing else: other processes' load does not count)."""
    world = 1
    for n in cand.sizes.values():
        world *= n
    per_rank = shardings.launch(_step_times, world, cand, cfg_kw, rows, steps, warmup)
    wall = statistics.median(max(w for w, _ in step) for step in zip(*per_rank))
    if cores is None:
        return wall
    return wall, statistics.median(sum(c for _, c in step) / cores for step in zip(*per_rank))


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's τ-a between two sequences (ties count as neither concordant nor discordant)."""
    pairs = list(itertools.combinations(range(len(xs)), 2))
    score = sum((xs[i] - xs[j]) * (ys[i] - ys[j]) > 0 for i, j in pairs) - \
        sum((xs[i] - xs[j]) * (ys[i] - ys[j]) < 0 for i, j in pairs)
    return score / len(pairs)


def validate(cluster: Cluster, rows: int = 16, rounds: int = 3, steps: int = 5, seed: int = 0) -> dict[str, Any]:
    """Predict and measure :data:`CANDIDATES` (module docstring); returns the table's rows and the scores."""
    cfg = models.gpt.Config(**_GPT_SMALL)
    cands = candidates()
    ranking = plan(models.gpt, cfg, (rows, cfg.seq_len), cluster, candidates=cands, top_k=len(cands),
                   budget_s=1e9)
    predicted = {c: ranking.row(c).timing.total for c in cands}
    measured: dict[Candidate, list[tuple[float, float]]] = {c: [] for c in cands}
    order = list(cands)
    rng = random.Random(seed)
    loads = []
    for _ in range(rounds):
        rng.shuffle(order)
        for c in order:
            loads.append(os.getloadavg()[0])
            measured[c].append(measure_step(c, dataclasses.asdict(cfg), rows, steps, cores=cluster.cores or 1))
    wall = {c: statistics.median(w for w, _ in v) for c, v in measured.items()}
    cpu = {c: statistics.median(u for _, u in v) for c, v in measured.items()}
    first = min(cands, key=lambda c: predicted[c])
    return {"rows": [{"candidate": str(c), "predicted_s": predicted[c], "measured_s": wall[c],
                      "spread": (min(w for w, _ in measured[c]), max(w for w, _ in measured[c])), "cpu_s": cpu[c]}
                     for c in cands],
            "tau": kendall_tau([predicted[c] for c in cands], [wall[c] for c in cands]),
            "tau_cpu": kendall_tau([predicted[c] for c in cands], [cpu[c] for c in cands]),
            "first": str(first), "fastest": str(min(cands, key=lambda c: wall[c])),
            "first_vs_fastest": wall[first] / min(wall.values()),
            "first_vs_fastest_cpu": cpu[first] / min(cpu.values()),
            "load": (min(loads), max(loads))}


def report(result: dict[str, Any]) -> str:
    """The validation as text (milliseconds per step)."""
    lines = [f"{'candidate':<36}{'predicted':>10}{'measured':>10}{'min..max':>16}{'cpu/cores':>10}"]
    for r in sorted(result["rows"], key=lambda r: r["measured_s"]):
        lo, hi = r["spread"]
        lines.append(f"{r['candidate']:<36}{r['predicted_s'] * 1e3:>10.0f}{r['measured_s'] * 1e3:>10.0f}"
                     f"{f'{lo * 1e3:.0f}..{hi * 1e3:.0f}':>16}{r['cpu_s'] * 1e3:>10.0f}")
    lo, hi = result["load"]
    lines.append(f"Kendall tau {result['tau']:.2f} (wall clock), {result['tau_cpu']:.2f} (CPU time over the cores); "
                 f"first choice {result['first']}: {result['first_vs_fastest']:.2f}x the fastest measured "
                 f"({result['fastest']}), {result['first_vs_fastest_cpu']:.2f}x by CPU time; load {lo:.1f}-{hi:.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=16)
    args = parser.parse_args(argv)
    from experiments.auto import load_cluster

    result = validate(load_cluster("this"), rows=args.rows, rounds=args.rounds, steps=args.steps)
    print(report(result))
    return result


if __name__ == "__main__":
    main()
