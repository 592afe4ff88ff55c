"""Throughput of ``core.random.normal`` against ``torch.randn`` (a benchmark, not a test).

``python -m experiments.bench.random_normal [--sizes 1048576 16777216] [--repeats 5] [--threads N]``

``core.random`` pays for being layout-invariant: about 110 int64 passes of Threefry-2x32-20 per pair
of samples, against torch's fused Philox kernel. It runs once per parameter at init, so what matters
is that the ratio stays a constant factor, never a blow-up with size.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from core import random


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: allocator, thread pool
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2**20, 2**24], help="float32 samples per draw")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per cell; the median is reported")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    key = random.key(0)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'samples':>10} | {'ours ms':>9} | {'randn ms':>9} | {'ours M/s':>9} | {'randn M/s':>9} | ours/randn")
    for n in args.sizes:
        ours = _median_seconds(lambda n=n: random.normal(key, (n,)), args.repeats)
        ref = _median_seconds(lambda n=n: torch.randn(n), args.repeats)
        print(
            f"{n:>10} | {ours * 1e3:>9.1f} | {ref * 1e3:>9.1f} | {n / ours / 1e6:>9.1f} | {n / ref / 1e6:>9.1f} |"
            f" {ours / ref:>9.1f}x"
        )


if __name__ == "__main__":
    main()
