"""The benches' row machinery: configs, one row built and timed, rows pooled over rounds and tabulated.

:mod:`experiments.bench.jit` (the single-device rows) and :mod:`experiments.bench.jit_sharded` (the sharded rows
on one rank) both time their rows here, so neither imports the other's module for it.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch._dynamo.utils import counters

import models.gpt as gpt
from core import tree

__all__ = ["CONFIGS", "Step", "run_plan", "table"]


class _Config(NamedTuple):
    model: dict[str, Any]  # gpt.Config fields
    batch: int  # rows per step


CONFIGS = {
    "tiny": _Config(dict(vocab=256, dim=64, layers=2, heads=4, mlp=192, seq_len=64), 8),
    "gpt_small": _Config(dict(vocab=2048, dim=256, layers=4, heads=8, mlp=768, seq_len=128), 8),
    "gpt_650m": _Config(dict(vocab=32000, dim=1536, layers=20, heads=12, mlp=4096, seq_len=2048), 8),
}

Step = Callable[[Any, Any, dict[str, torch.Tensor]], tuple[Any, Any, torch.Tensor]]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(step: Step, state: list, batch: dict, steps: int, warmup: int, device: str) -> dict[str, Any]:
    """Run ``warmup`` then ``steps`` steps from ``state`` (emptied: no stale copy held); the first is timed alone."""
    graphs = counters["stats"]["unique_graphs"]
    start = time.perf_counter()
    a, b, loss = step(*state, batch)
    state.clear()
    _sync(device)
    first_s, first_loss = time.perf_counter() - start, float(loss)
    times = []
    for i in range(warmup - 1 + steps):
        start = time.perf_counter()
        a, b, loss = step(a, b, batch)
        _sync(device)
        if i >= warmup - 1:
            times.append(time.perf_counter() - start)
    graphs = counters["stats"]["unique_graphs"] - graphs
    return {"times": times, "first_s": first_s, "loss": first_loss, "graphs": graphs}


def _measure(
    build: Callable[[], tuple[Step, list]], tracing: Callable, batch: dict, steps: int, warmup: int, device: str
) -> dict[str, Any]:
    """One row: a fresh dynamo cache, ``build()``'s step and state timed, and on CUDA the peak bytes it added."""
    torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    step, state = build()
    with tracing():
        result = _timed(step, state, batch, steps, warmup, device)
    result["peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20 if device == "cuda" else None
    return result


def _flops_per_token(cfg: gpt.Config, params: Any) -> float:
    n = sum(p.numel() for p in tree.leaves(params)) - params["embed"].numel()
    return 6 * n + 12 * cfg.layers * cfg.heads * cfg.d_head * cfg.seq_len


def _ratio(x: float | None, ref: float | None) -> float | str:
    return round(x / ref, 3) if x is not None and ref else ""


def _pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A row's rounds as one: the median over every timed step; the first round's compile time, loss, graphs, peak."""
    return runs[0] | {"median_s": statistics.median(t for r in runs for t in r["times"])}


def run_plan(plan: dict[str, tuple[Callable, Callable]], batch: dict, steps: int, warmup: int, device: str,
             rounds: int) -> dict[str, dict[str, Any]]:
    """Each row of ``plan`` (name -> (build, tracing context)) measured ``rounds`` times, alternated (a, b, c, then
    c, b, a, ...), and its rounds pooled (:func:`_pool`)."""
    runs: dict[str, list[dict]] = {name: [] for name in plan}
    for k in range(rounds):
        for name in list(plan) if k % 2 == 0 else list(plan)[::-1]:
            runs[name].append(_measure(*plan[name], batch, steps, warmup, device))
    return {name: _pool(r) for name, r in runs.items()}


def table(results: dict[str, dict[str, Any]], config: str, device: str, cfg: gpt.Config, params: Any, tokens: int,
          peak_tflops: float, steps: int, rounds: int, eager: tuple[str, ...], jit_backend: str,
          native: str = "native", compiled: str = "native_compile") -> list[dict]:
    """One output row per result: step time, tokens/s, multiples of the ``native`` and ``compiled`` rows' time and
    peak memory, compile time and backend (0 and empty for the ``eager`` rows), graphs, step-1 loss and (CUDA)
    MFU."""
    native_row, compiled_row = results[native], results.get(compiled, {})
    out = []
    for name, r in results.items():
        tok_s = tokens / r["median_s"]
        mfu = _flops_per_token(cfg, params) * tok_s / (peak_tflops * 1e12) if device == "cuda" else None
        out.append({
            "config": config, "device": device, "variant": name, "steps": steps, "rounds": rounds,
            "step_ms": round(r["median_s"] * 1e3, 2), "tokens_per_s": round(tok_s, 1),
            "vs_native": _ratio(r["median_s"], native_row["median_s"]),
            "vs_compiled": _ratio(r["median_s"], compiled_row.get("median_s")),
            "peak_mb": round(r["peak_mb"], 1) if r["peak_mb"] is not None else "",
            "mem_vs_native": _ratio(r["peak_mb"], native_row["peak_mb"]),
            "mem_vs_compiled": _ratio(r["peak_mb"], compiled_row.get("peak_mb")),
            "compile_s": round(r["first_s"], 2) if name not in eager else 0.0,
            "jit_backend": jit_backend if name not in eager else "",
            "graphs": r["graphs"], "loss": round(r["loss"], 6),
            "mfu": round(mfu, 4) if mfu is not None else "",
        })  # fmt: skip
    return out
