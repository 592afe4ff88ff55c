"""Equivalence at cluster scale: a shrunken Llama-3 under torchtitan's 405B layout on simulated ranks.

``python -m experiments.bench.scale [--world 512|64|8] [--microbatches M]`` (``make test-scale``: 512)

``check_equivalence`` of ``models.gpt`` with GQA, RoPE and SwiGLU at tiny dims and 16 blocks under
``zero3+tp+sp+pp``, interleaved 1F1B with two stages per rank, ``M`` microbatches (default 2·pp: accumulation),
global-norm clipping, one AdamW step, against one device. Meshes: 512 = Mesh(pp=8, dp=8, tp=8) (the 405B layout),
64 = Mesh(pp=4, dp=4, tp=4), 8 = Mesh(pp=2, dp=2, tp=2). Prints the wall and CPU seconds, the peak RSS of this
process, and whether it passed; exits 1 when it did not.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import models.gpt as gpt
from shardings import Mesh, pipeline
from shardings.testing import check_equivalence

__all__ = ["LLAMA", "MESHES", "main", "run"]

MESHES = {512: (8, 8, 8), 64: (4, 4, 4), 8: (2, 2, 2)}  # world -> (pp, dp, tp)
# Llama-3's shape at toy size: GQA (16 query heads on 8 kv heads, so tp8 splits both), RoPE at Llama-3's base,
# SwiGLU, RMSNorm, untied unembedding; 16 blocks: one per stage at pp8 with two stages per rank.
LLAMA = gpt.Config(vocab=64, dim=32, layers=16, heads=16, kv_heads=8, head_dim=2, seq_len=8, mlp=64,
                   rope_theta=500000.0)


def run(world: int, microbatches: int | None = None) -> dict:
    """One check at ``world``: its seconds, CPU seconds, peak RSS (GiB) and whether it passed."""
    pp, dp, tp = MESHES[world]
    m = microbatches or 2 * pp
    mesh = Mesh(pp=pp, dp=dp, tp=tp)
    batch = gpt.example_batch(LLAMA, dp * m, with_ignored=True)
    schedule = pipeline.build("interleaved_1f1b", pp, m, virtual_stages=2)
    t0, c0 = time.perf_counter(), time.process_time()
    report = check_equivalence(gpt.init, gpt.loss, gpt.axes, LLAMA, batch, layouts=["zero3+tp+sp+pp"], mesh=mesh,
                               stages=gpt.stages, schedule=schedule, accum_steps=m, clip_norm=0.5, steps=1,
                               raise_on_failure=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return {"world": world, "mesh": repr(mesh), "microbatches": m, "seconds": round(time.perf_counter() - t0, 1),
            "cpu_seconds": round(time.process_time() - c0, 1), "peak_rss_gib": round(peak, 2), "ok": report.ok,
            "report": report}


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the check, print one line; 0 when it passed."""
    ap = argparse.ArgumentParser(prog="python -m experiments.bench.scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=512, choices=sorted(MESHES))
    ap.add_argument("--microbatches", type=int, default=None, help="default 2*pp")
    args = ap.parse_args(argv)
    row = run(args.world, args.microbatches)
    if not row["ok"]:
        print(row["report"].table())
    print(f"world {row['world']} ({row['mesh']}, interleaved 1F1B x2, {row['microbatches']} microbatches): "
          f"{row['seconds']} s wall, {row['cpu_seconds']} s CPU, peak RSS {row['peak_rss_gib']} GiB, "
          f"equal {'yes' if row['ok'] else 'NO'}")
    return 0 if row["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
