"""How fast simulated ranks are: check_equivalence seconds at 16/64/128 ranks, and simulated vs real tokens/s.

``python -m experiments.bench.simulate [--worlds 16 64 128] [--steps 6] [--no-train] [--csv PATH]``

* **equivalence** — per world, ``check_equivalence`` of a small gpt (GQA, RoPE, SwiGLU; 4 blocks) under
  ``zero3+tp+sp+pp``: 1F1B, one AdamW step, accumulation 2·pp microbatches, clipping, on simulated ranks
  (``runtime="simulate"``). Meshes: 16 = dp4 × pp2 × tp2, 64 = dp4 × pp4 × tp4, 128 = dp8 × pp4 × tp4
  (and 8 = dp2 × pp2 × tp2; 4 = dp1 × pp2 × tp2, the cheap setting the test runs). Wall seconds of the whole check (the
  single-device reference included), this process's CPU seconds (what a loaded machine changes least) and
  whether it passed.
* **train** — ``experiments.train`` of ``gpt_small`` (zero3+tp on dp2 × tp2) for ``--steps`` steps, once on
  ``runtime=simulate`` (4 ranks in this process) and once on 4 real gloo processes (``runtime=multiprocess``),
  in this run: each run's tokens/s (after its first step) and simulated / real.

* **--ab** — per world, the same check twice in this run: torch's per-rank loop (``SHARDLAB_SIMULATE_FAST=0``) and
  shardlab's (:mod:`shardings.runtime.fastlocal`, the default): CPU seconds of each, ``speedup`` (torch's /
  shardlab's) and ``rank_ops`` (ops x ranks through shardlab's loop, from ``shardings.simulated_calls()``: a count
  of the work that no machine load changes).

Wall-clock numbers: on a loaded machine compare runs made at the same time, not across days.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import models.gpt as gpt
from shardings import Mesh, simulated_calls
from shardings.testing import check_equivalence

__all__ = ["MESHES", "ab_row", "equivalence_row", "main", "train_row"]

# world -> (dp, pp, tp)
MESHES = {4: (1, 2, 2), 8: (2, 2, 2), 16: (4, 2, 2), 64: (4, 4, 4), 128: (8, 4, 4)}
CFG = gpt.Config(vocab=64, dim=32, layers=4, heads=8, kv_heads=4, seq_len=8, mlp=64)


def equivalence_row(world: int) -> dict[str, Any]:
    """One row of the equivalence table: ``check_equivalence`` of ``CFG`` under zero3+tp+sp+pp at ``world``."""
    dp, pp, tp = MESHES[world]
    mesh = Mesh(dp=dp, pp=pp, tp=tp)
    microbatches = 2 * pp
    batch = gpt.example_batch(CFG, dp * microbatches, with_ignored=True)
    t0, c0 = time.perf_counter(), time.process_time()
    report = check_equivalence(gpt.init, gpt.loss, gpt.axes, CFG, batch, layouts=["zero3+tp+sp+pp"], mesh=mesh,
                               stages=gpt.stages, schedule="1f1b", accum_steps=microbatches, clip_norm=0.5,
                               steps=1, raise_on_failure=False)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"world": world, "mesh": f"dp{dp} x pp{pp} x tp{tp}", "seconds": round(seconds, 1),
            "cpu_seconds": round(cpu, 1), "equal": "yes" if report.ok else "NO"}


VARIANTS = {"torch": "0", "fast": "1"}  # name -> SHARDLAB_SIMULATE_FAST of that run


def ab_row(world: int) -> dict[str, Any]:
    """The check at ``world`` under each of :data:`VARIANTS`, in this run: CPU seconds, speed-up, rank-ops."""
    row: dict[str, Any] = {"world": world, "mesh": "dp{} x pp{} x tp{}".format(*MESHES[world])}
    saved = os.environ.get("SHARDLAB_SIMULATE_FAST")
    try:
        for name, fast in VARIANTS.items():
            os.environ["SHARDLAB_SIMULATE_FAST"] = fast
            simulated_calls(reset=True)
            one = equivalence_row(world)
            row[f"{name}_cpu_s"] = one["cpu_seconds"]
            row["equal"] = "yes" if row.get("equal", "yes") == "yes" and one["equal"] == "yes" else "NO"
            if name == "fast":
                row["rank_ops"] = simulated_calls()["rank_ops"]
    finally:
        os.environ.pop("SHARDLAB_SIMULATE_FAST", None)
        if saved is not None:
            os.environ["SHARDLAB_SIMULATE_FAST"] = saved
    row["speedup"] = round(row["torch_cpu_s"] / row["fast_cpu_s"], 2)
    return row


def _tokens_per_s(runtime: str, steps: int) -> float:
    from hydra import compose, initialize

    from experiments.config import app_overrides, own_model, register
    from experiments.train import run

    overrides = app_overrides(["model=gpt_small", "layout=zero3+tp", "mesh=dp2_tp2", f"runtime={runtime}",
                               f"steps={steps}", "progress=false", "data.max_bytes=200000"])
    register()
    with initialize(version_base="1.3", config_path=None):
        cfg = own_model(compose("train", overrides=overrides), overrides)
    with tempfile.TemporaryDirectory() as out:
        return float(run(cfg, out)["tokens_per_s"])


def train_row(steps: int) -> dict[str, Any]:
    """gpt_small tokens/s on 4 simulated ranks and on 4 real gloo processes, measured now, and their ratio."""
    sim = _tokens_per_s("simulate", steps)
    real = _tokens_per_s("multiprocess", steps)
    return {"simulated_tok_s": round(sim, 1), "real_tok_s": round(real, 1), "ratio": round(sim / real, 3)}


def _print_table(rows: list[dict[str, Any]]) -> None:
    keys = list(rows[0])
    widths = [max(len(k), *(len(str(r[k])) for r in rows)) for k in keys]
    print("| " + " | ".join(k.ljust(w) for k, w in zip(keys, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(str(r[k]).ljust(w) for k, w in zip(keys, widths)) + " |")


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv``, measure, print both tables (and write the equivalence one as CSV with ``--csv``)."""
    ap = argparse.ArgumentParser(prog="python -m experiments.bench.simulate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="*", default=[16, 64, 128], choices=sorted(MESHES))
    ap.add_argument("--steps", type=int, default=6, help="train steps per runtime (the first one is not timed)")
    ap.add_argument("--no-train", action="store_true", help="skip the simulated/real tokens/s comparison")
    ap.add_argument("--csv", default=None, help="also write the equivalence table here")
    ap.add_argument("--ab", action="store_true", help="each world under torch's loop and shardlab's (CPU s)")
    args = ap.parse_args(argv)
    rows = []
    for world in args.worlds:
        rows.append(ab_row(world) if args.ab else equivalence_row(world))
        print(f"world {world}: {rows[-1]}", flush=True)
    if rows:
        print("\ncheck_equivalence, zero3+tp+sp+pp (1F1B, 1 AdamW step, accumulation 2*pp), simulated ranks:")
        _print_table(rows)
        if args.csv:
            from experiments.bench.tables import write_csv

            write_csv(args.csv, rows)
    if not args.no_train:
        row = train_row(args.steps)
        print("\ngpt_small, zero3+tp on dp2 x tp2, tokens/s (after the first step), simulated vs real gloo:")
        _print_table([row])


if __name__ == "__main__":
    main()
