"""A whole single-device train step, eager vs ``core.jit`` (torch.compile) (a benchmark, not a test).

``python -m experiments.bench_jit [--configs tiny gpt_small] [--device cpu|cuda] [--steps 20]
[--warmup 3] [--peak-tflops 989] [--as-is] [--threads N] [--csv bench_jit.csv]``

One step is ``core.value_and_grad(gpt.loss)`` + ``adamw`` update + ``apply_updates`` on plain tensors
(:func:`make_step`). The jitted row compiles that whole function with ``core.jit`` (inductor;
on CPU it needs a C++ compiler) into **one graph** — forward, backward and the foreach optimizer
update — under :func:`whole_step_tracing`, which lifts the two graph breaks a plain
``core.jit(step)`` hits (``--as-is`` adds that row, with its graph count):

1. ``torch.autograd.grad`` (inside ``core.value_and_grad``) is a graph break unless
   ``torch._dynamo.config.trace_autograd_ops`` is on; the break then also splits the graph at every
   ``requires_grad_()`` leaf;
2. ``shardings.constrain`` (called by the models) reads a ``ContextVar``, which dynamo cannot
   trace: one graph break per call. With no mesh active its answer is ``None``, so it is marked
   constant while the step compiles (checked: no mesh may be active).

Reported per row: median step time after warm-up, tokens/s, speedup over eager, compile time (the
first jitted call: compile + one step) and the step-1 loss (both rows must agree, rtol 1e-4).
On ``--device cuda`` the step runs under bf16 autocast (fp32 master params and Adam state) and
the table adds MFU = (6·N + 12·layers·heads·head_dim·seq_len) · tokens/s / peak, with N the
params outside the input embedding (a lookup, no FLOPs) and the attention term PaLM's (appendix B).

Configs: ``tiny`` (seconds to compile), ``gpt_small`` (as experiments/bench.py), ``gpt_650m``
(for a GPU: ~0.65B params, seq 2048).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch._dynamo.utils import counters

import core
import models.gpt as gpt
import shardings
from core import optim, tree
from experiments.tables import write_csv


class _Config(NamedTuple):
    model: dict[str, Any]  # gpt.Config fields
    batch: int  # rows per step


CONFIGS = {
    "tiny": _Config(dict(vocab=256, dim=64, layers=2, heads=4, mlp=192, seq_len=64), 8),
    "gpt_small": _Config(dict(vocab=2048, dim=256, layers=4, heads=8, mlp=768, seq_len=128), 8),
    "gpt_650m": _Config(dict(vocab=32000, dim=1536, layers=20, heads=12, mlp=4096, seq_len=2048), 8),
}

Step = Callable[[Any, Any, dict[str, torch.Tensor]], tuple[Any, Any, torch.Tensor]]


def make_step(cfg: gpt.Config, opt: optim.GradientTransformation, autocast: torch.dtype | None = None) -> Step:
    """``step(params, opt_state, batch) -> (params, opt_state, loss)``: grad, AdamW update, apply.

    >>> cfg = gpt.Config(layers=1)
    >>> step = make_step(cfg, optim.adamw(1e-3))
    >>> params = gpt.init(core.random.key(0), cfg)
    >>> params, state, loss = step(params, optim.adamw(1e-3).init(params), gpt.example_batch(cfg, 2))
    """

    def loss_fn(params: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        device = batch["tokens"].device.type
        with torch.autocast(device, dtype=autocast) if autocast else contextlib.nullcontext():
            return gpt.loss(params, batch, cfg)

    # Built once, outside the step: functools.wraps inside value_and_grad is itself a graph break.
    value_and_grad = core.value_and_grad(loss_fn)

    def step(params: Any, opt_state: Any, batch: dict[str, torch.Tensor]) -> tuple[Any, Any, torch.Tensor]:
        loss, grads = value_and_grad(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    return step


@contextlib.contextmanager
def whole_step_tracing() -> Iterator[None]:
    """Let ``core.jit`` trace a single-device step as one graph (see the module docstring).

    Raises:
        RuntimeError: a mesh is active (``shardings.use``): ``constrain`` is not a no-op then.
    """
    if shardings.current() is not None:
        raise RuntimeError(
            "whole_step_tracing assumes shardings.current() is None, but a mesh is active. "
            "Fix: compile the single-device step outside shardings.use(...)."
        )
    current = shardings.spec.context.current
    current._dynamo_marked_constant = True  # what torch.compiler.assume_constant_result sets
    try:
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            yield
    finally:
        del current._dynamo_marked_constant


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(step: Step, state: tuple, batch: dict, steps: int, warmup: int, device: str) -> dict[str, Any]:
    """Run ``warmup`` then ``steps`` steps from ``state``; the first call is timed on its own."""
    graphs = counters["stats"]["unique_graphs"]
    start = time.perf_counter()
    params, opt_state, loss = step(*state, batch)
    _sync(device)
    first_s, first_loss = time.perf_counter() - start, float(loss)
    times = []
    for i in range(warmup - 1 + steps):
        start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, batch)
        _sync(device)
        if i >= warmup - 1:
            times.append(time.perf_counter() - start)
    graphs = counters["stats"]["unique_graphs"] - graphs
    return {"median_s": statistics.median(times), "first_s": first_s, "loss": first_loss, "graphs": graphs}


def _flops_per_token(cfg: gpt.Config, params: Any) -> float:
    n = sum(p.numel() for p in tree.leaves(params)) - params["embed"].numel()
    return 6 * n + 12 * cfg.layers * cfg.heads * cfg.d_head * cfg.seq_len


def run(config: str, device: str, steps: int, warmup: int, peak_tflops: float, as_is: bool = False) -> list[dict]:
    """Time eager and jitted steps of ``config`` on ``device``; one row per variant.

    Raises:
        RuntimeError: the jitted step's first loss differs from eager's (rtol 1e-4).
    """
    model_kw, batch_size = CONFIGS[config]
    cfg = gpt.Config(**model_kw)
    with torch.device(device):
        params = gpt.init(core.random.key(0), cfg)
    batch = {k: v.to(device) for k, v in gpt.example_batch(cfg, batch_size).items()}
    opt = optim.adamw(1e-3, weight_decay=0.01)
    step = make_step(cfg, opt, autocast=torch.bfloat16 if device == "cuda" else None)
    state = (params, opt.init(params))
    results = {"eager": _timed(step, state, batch, steps, warmup, device)}
    torch._dynamo.reset()
    with whole_step_tracing():
        results["jit"] = _timed(core.jit(step), state, batch, steps, warmup, device)
    if as_is:
        torch._dynamo.reset()
        results["jit_as_is"] = _timed(core.jit(step), state, batch, steps, warmup, device)
    eager = results["eager"]
    for name, r in results.items():
        if abs(r["loss"] - eager["loss"]) > 1e-4 * max(1.0, abs(eager["loss"])):
            raise RuntimeError(
                f"bench_jit {config}: step-1 loss of {name} is {r['loss']}, eager's {eager['loss']}. "
                "Fix: the compiled step does not compute the eager step's function; bisect with backend='aot_eager'."
            )
    tokens = batch_size * cfg.seq_len
    rows = []
    for name, r in results.items():
        tok_s = tokens / r["median_s"]
        mfu = _flops_per_token(cfg, params) * tok_s / (peak_tflops * 1e12) if device == "cuda" else None
        rows.append({
            "config": config, "device": device, "variant": name, "steps": steps,
            "step_ms": round(r["median_s"] * 1e3, 2), "tokens_per_s": round(tok_s, 1),
            "speedup": round(eager["median_s"] / r["median_s"], 3),
            "compile_s": round(r["first_s"], 2) if name != "eager" else 0.0,
            "graphs": r["graphs"], "loss": round(r["loss"], 6),
            "mfu": round(mfu, 4) if mfu is not None else "",
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["tiny", "gpt_small"], choices=list(CONFIGS))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first one compiles)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="peak bf16 TFLOP/s for MFU (H100 SXM: 989)")
    parser.add_argument("--as-is", action="store_true", help="also time core.jit(step) without whole_step_tracing")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--csv", default="bench_jit.csv", help="where to write the table")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    run_one = functools.partial(run, device=args.device, steps=args.steps, warmup=max(args.warmup, 1))
    rows = [r for c in args.configs for r in run_one(c, peak_tflops=args.peak_tflops, as_is=args.as_is)]
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads, median of {args.steps} steps")
    cols = ["config", "variant", "step_ms", "tokens_per_s", "speedup", "compile_s", "graphs", "loss", "mfu"]
    print(" | ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]!s:>12}" for c in cols))
    write_csv(args.csv, rows)
    return rows


if __name__ == "__main__":
    main()
