"""AdamW update on a gpt's parameter list: per leaf vs foreach vs ``torch.optim`` (a benchmark, not a test).

``python -m experiments.bench.optim [--configs gpt_small narrow] [--repeats 30] [--threads N] [--csv F]``

One timed step is ``opt.update`` then ``apply_updates`` (ours: a pure function returning new params
and state) or ``torch.optim.AdamW.step()`` (in place, on ``.grad``), on plain float32 tensors shaped
like ``models.gpt.init``'s params. Six rows per config:

- ``per_leaf``: ours inside ``core.optim.foreach.per_leaf()`` (one ``tree.map`` call per op per leaf);
- ``foreach``: ours as shipped (``torch._foreach_*`` over the leaf list);
- ``fused_step``: ours in place on donated buffers (``adamw(...).fused_step``: torch's fused kernel),
  what ``train_step(donate=True)`` runs on local shards;
- ``torch_foreach`` / ``torch_for_loop`` / ``torch_fused``: ``torch.optim.AdamW(foreach=True / False,
  fused=True)``.

Configs: ``gpt_small`` (as experiments/bench/wrappers.py: 39 leaves, 3.7M params; memory-bound kernels),
``narrow`` (16 thin layers: 147 small leaves, where per-op Python overhead dominates).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import torch

import core
import models.gpt as gpt
from core import optim, tree
from experiments.bench.tables import write_csv

_CONFIGS = {
    "gpt_small": dict(vocab=2048, dim=256, layers=4, heads=8, mlp=768, seq_len=128),
    "narrow": dict(vocab=256, dim=64, layers=16, heads=4, mlp=192, seq_len=64),
}


def _median_ms(steps: dict[str, Callable[[], None]], repeats: int, warmup: int = 3) -> dict[str, float]:
    """Median ms per variant; the variants take turns each round, so load drift hits them alike."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def _ours(params: dict, grads: dict, per_leaf: bool) -> Callable[[], None]:
    opt = optim.adamw(1e-3, weight_decay=0.01)
    box = [params, opt.init(params)]

    def step() -> None:
        with optim.foreach.per_leaf() if per_leaf else contextlib.nullcontext():
            updates, box[1] = opt.update(grads, box[1], box[0])
            box[0] = optim.apply_updates(box[0], updates)

    return step


def _ours_fused(params: dict, grads: dict) -> Callable[[], None]:
    opt = optim.adamw(1e-3, weight_decay=0.01)
    box = [tree.map(torch.clone, params), None]
    box[1] = opt.init(box[0])

    def step() -> None:
        box[0], box[1] = opt.fused_step(grads, box[1], box[0])

    return step


def _torch(params: dict, grads: dict, foreach: bool, fused: bool = False) -> Callable[[], None]:
    ps = [p.clone().requires_grad_(True) for p in tree.leaves(params)]
    for p, g in zip(ps, tree.leaves(grads)):
        p.grad = g.clone()
    opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=None if fused else foreach, fused=fused or None)
    return opt.step


def run(config: str, repeats: int) -> list[dict]:
    """Time the six variants on ``config``'s param shapes; one row each (ms, ratio to ``torch_foreach``)."""
    cfg = gpt.Config(**_CONFIGS[config])
    params = gpt.init(core.random.key(0), cfg)
    gen = torch.Generator().manual_seed(0)
    grads = tree.map(lambda p: torch.randn(p.shape, generator=gen), params)
    steps = {
        "per_leaf": _ours(params, grads, per_leaf=True),
        "foreach": _ours(params, grads, per_leaf=False),
        "fused_step": _ours_fused(params, grads),
        "torch_foreach": _torch(params, grads, foreach=True),
        "torch_for_loop": _torch(params, grads, foreach=False),
        "torch_fused": _torch(params, grads, foreach=False, fused=True),
    }
    with torch.no_grad():
        ms = _median_ms(steps, repeats)
    leaves = tree.leaves(params)
    return [
        {
            "config": config, "leaves": len(leaves), "params": sum(p.numel() for p in leaves), "variant": name,
            "ms": round(t, 3), "vs_torch_foreach": round(t / ms["torch_foreach"], 3),
            "vs_per_leaf": round(t / ms["per_leaf"], 3),
        }
        for name, t in ms.items()
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(_CONFIGS), choices=list(_CONFIGS))
    parser.add_argument("--repeats", type=int, default=30, help="timed steps per variant (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--csv", default=None, help="also write the table here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [r for config in args.configs for r in run(config, args.repeats)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats} steps")
    print(f"{'config':>10} {'leaves':>6} {'params':>9} | {'variant':>14} | {'ms':>8} | vs torch_foreach | vs per_leaf")
    for r in rows:
        print(
            f"{r['config']:>10} {r['leaves']:>6} {r['params']:>9} | {r['variant']:>14} | {r['ms']:>8.3f} |"
            f" {r['vs_torch_foreach']:>16.2f} | {r['vs_per_leaf']:>11.2f}"
        )
    if args.csv:
        write_csv(args.csv, rows)
    return rows


if __name__ == "__main__":
    main()
