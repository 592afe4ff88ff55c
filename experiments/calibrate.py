"""Measure this machine for the planner: matmul FLOP/s, memory bandwidth, per-op dispatch, gloo's α and β.

``python -m experiments.plan calibrate`` runs :func:`calibrate` and writes ``experiments/conf/cluster/this.yaml``
(the cluster ``this``), so the planner predicts step times here. What is measured (medians of repeats):

- ``flops`` and ``matmul_curve``: n³ matmuls per dtype in one process, n from 32 to 512 (one core's rates; the
  ranks share ``cores``): small matmuls run far below a large one's rate;
- ``mem_bandwidth`` and ``bandwidth_curve``: ``a + b`` on fp32 tensors of 16 KiB to 16 MiB (3 tensors' bytes per
  op): small tensors stay in cache;
- ``op_overhead``, ``dtensor_overhead`` and ``data_dtensor_overhead``: what an op costs in a real step beyond its
  FLOPs and bytes (eager dispatch, autograd, the framework's Python): reference steps of a tiny gpt under ``dp``
  (plain tensors), ``tp`` (DTensors laid out over a model-parallel axis) and ``dp+pp`` (a pipeline stage's
  DTensors, laid out over data axes only: cached propagation, about a third of a tp op's cost here) on ``world``
  gloo processes, less the rest of the planner's model, over their ops of each kind;
- ``overlap`` is 0: gloo's collectives use the cores the ranks compute on, so none hides behind compute;
- ``intra``: all-reduces on ``world`` gloo processes from 4 B to 4 MiB, fitted to ``α + sent / β`` with
  sent = 2(n−1)/n · B (the bytes ``shardings.comms()`` counts): the ranks' CPU time per collective.

Times are CPU time (of all ranks, shared over the machine's cores, for anything that runs on several processes):
what the step takes on this machine running nothing else, whatever else runs while it is measured (the load of
other processes inflates wall-clock times several-fold here, and unevenly).
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import shardings

__all__ = ["REFERENCES", "calibrate", "dispatch_costs", "gloo_link", "write"]


def _timeit(fn: Any, repeat: int = 7, number: int = 1) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - start) / number)
    return statistics.median(times)


def matmul_flops(dtype: torch.dtype, n: int = 512) -> float:
    """FLOP/s of an ``n``³ matmul in ``dtype`` on this process."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _timeit(lambda: a @ b, number=max(3, 2**24 // n**3))


def matmul_curve(dtype: torch.dtype, sizes: tuple[int, ...] = (32, 64, 128, 256, 512)) -> list[list[float]]:
    """``[FLOPs of one n³ matmul, FLOP/s]`` for each ``n``: small matmuls run far below a large one's rate."""
    return [[2.0 * n**3, matmul_flops(dtype, n)] for n in sizes]


def memory_bandwidth(numel: int = 4 * 2**20) -> float:
    """Bytes/s of ``a + b`` on fp32 tensors (reads two, writes one)."""
    a, b, out = torch.randn(numel), torch.randn(numel), torch.empty(numel)
    return 3 * 4 * numel / _timeit(lambda: torch.add(a, b, out=out), number=max(5, 2**22 // numel))


def bandwidth_curve(sizes: tuple[int, ...] = (2**12, 2**14, 2**16, 2**18, 2**20, 2**22)) -> list[list[float]]:
    """``[bytes one op moves, bytes/s]`` of ``a + b`` at each size: small tensors stay in cache."""
    return [[3.0 * 4 * n, memory_bandwidth(n)] for n in sizes]


def _all_reduce_cpu(sizes: list[int], repeat: int) -> list[float]:
    """This process's CPU seconds per all-reduce of each size (median of ``repeat`` runs of 10)."""
    out = []
    for numel in sizes:
        x = torch.ones(numel)
        runs = []
        for _ in range(repeat):
            dist.barrier()
            start = time.process_time()
            for _ in range(10):
                dist.all_reduce(x)
            runs.append((time.process_time() - start) / 10)
        out.append(statistics.median(runs))
    return out


def gloo_link(world: int, cores: float, repeat: int = 5) -> dict[str, float]:
    """gloo's ``α`` (s) and ``β`` (bytes/s sent per rank) between ``world`` processes here, by least squares on
    the ranks' CPU time per all-reduce shared over ``cores`` (what it takes on the machine alone)."""
    sizes = [1, 256, 4096, 65536, 262144, 1048576]
    per_rank = shardings.launch(_all_reduce_cpu, world, sizes, repeat)
    times = [sum(ts) / cores for ts in zip(*per_rank)]
    sent = [2 * (world - 1) / world * 4 * n for n in sizes]
    mx, my = statistics.fmean(sent), statistics.fmean(times)
    slope = sum((x - mx) * (y - my) for x, y in zip(sent, times)) / sum((x - mx) ** 2 for x in sent)
    alpha = max(my - slope * mx, min(times))
    return {"alpha": float(alpha), "bandwidth": float(1 / slope)}


_REFERENCE = dict(vocab=64, dim=16, layers=2, heads=4, kv_heads=4, mlp=32, seq_len=16)  # compute is negligible
# the local path, the DTensor path (tp) and a pipeline's stages (DTensors over data axes only): one op kind each
REFERENCES = (("dp", {"dp": 4}, 1, None), ("tp", {"tp": 4}, 1, None), ("dp+pp", {"pp": 2, "dp": 2}, 2, "1f1b"))
_OPS = ("local", "dtensor", "dtensor_data")  # the op kinds the fake step counts, in REFERENCES' order


def dispatch_costs(cluster: dict[str, Any], world: int, rows: int = 8, repeat: int = 3) -> tuple[float, ...]:
    """Seconds per op on plain tensors, on model-parallel DTensors and on data-axis-only DTensors, from reference
    steps of a tiny gpt (:data:`REFERENCES`) on ``world`` gloo processes: each step's time (the ranks' CPU time
    over the cores), less what the planner's model gives it without dispatch, over its ops of each kind (counted
    on fake tensors) — three equations, three unknowns."""
    import models
    from experiments.bench.plan import measure_step
    from shardings.planner import Candidate, Cluster, plan

    cfg = models.gpt.Config(**_REFERENCE)
    base = Cluster.from_dict(cluster | {"op_overhead": 0.0, "dtensor_overhead": 0.0, "data_dtensor_overhead": 0.0})
    scale = world / base.cores if base.cores and world > base.cores else 1.0  # ranks share the cores
    matrix, rhs = [], []
    for layout, sizes, m, schedule in REFERENCES:
        cand = Candidate(layout, tuple(sizes.items()), m, schedule)
        row = plan(models.gpt, cfg, (rows, cfg.seq_len), base, candidates=[cand], top_k=1, budget_s=1e9).row(cand)
        measured = statistics.median(measure_step(cand, _REFERENCE, rows, cores=base.cores or 1)[1]
                                     for _ in range(repeat))
        # the ranks' ops over the cores (cost.step_time): every rank's, or under pp world/pp replicas' of all stages
        pred = row.prediction
        work, share = (pred.replica, scale / cand.size("pp")) if pred.replica else (pred.work, scale)
        matrix.append([work.ops.get(k, 0) * share for k in _OPS])
        rhs.append(measured - row.timing.total)
    solved = torch.linalg.solve(torch.tensor(matrix, dtype=torch.float64), torch.tensor(rhs, dtype=torch.float64))
    return tuple(max(float(x), 0.0) for x in solved)


def calibrate(world: int = 4) -> dict[str, Any]:
    """Every number of the cluster ``this`` (module docstring), as plain values for its config."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    link = gloo_link(world, cores)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with _threads(1):  # one core's rates: the ranks share the cores (``cores``)
        curve = {"float32": matmul_curve(torch.float32), "bfloat16": matmul_curve(torch.bfloat16, (32, 64, 128))}
        flops = {d: max(rate for _, rate in points) for d, points in curve.items()}
        bandwidths = bandwidth_curve()
        bandwidth = bandwidths[-1][1]
    out = {
        "name": "this",
        "nodes": 1,
        "per_node": world,
        "memory": float(ram / world),
        "flops": flops,
        "efficiency": 1.0,
        "mem_bandwidth": bandwidth,
        "op_overhead": 0.0,
        "dtensor_overhead": 0.0,
        "data_dtensor_overhead": 0.0,
        "async_dispatch": False,
        "intra": link,
        "inter": link,
        "host_bandwidth": bandwidth,
        "cores": float(cores),
        "overlap": 0.0,  # gloo's collectives run on the cores the ranks compute on: nothing hides behind compute
        "matmul_curve": curve,
        "bandwidth_curve": bandwidths,
    }
    out["op_overhead"], out["dtensor_overhead"], out["data_dtensor_overhead"] = dispatch_costs(out, world)
    return out


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def write(profile: dict[str, Any], path: Path) -> Path:
    """Write ``profile`` as the cluster config at ``path``, with a header saying where and when it was measured."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    header = (f"# This machine ({platform.node()}, {profile['cores']:.0f} cores), measured by "
              f"`python -m experiments.plan calibrate` on {time.strftime('%Y-%m-%d')} at load {load:.1f}.\n"
              "# Times are CPU time over the cores (the machine running only the step): experiments/calibrate.py.\n"
              "# Measure again where you plan: every number depends on the machine.\n")
    path.write_text(header + OmegaConf.to_yaml(OmegaConf.create(profile)))
    return path
