"""Our layouts against torch's own wrappers, side by side (a benchmark, not a test).

``python -m experiments.bench [--quick] [--pairs dp zero3] [--steps 20] [--csv bench.csv]``

Each side runs in its own ``shardings.launch`` (4 real processes; gloo on CPU, nccl on GPU) on the
same ``models.gpt`` weights, global batch, fp32 and AdamW(1e-3):

- ``dp`` vs ``DistributedDataParallel``; ``zero3`` vs FSDP2 ``fully_shard`` (one group: the model's
  blocks are dicts of tensors, not modules, so there is no per-block wrapping to give FSDP2).

The torch side is an ``nn.Module`` holding the same tensors as parameters whose ``forward`` calls
``gpt.loss`` on them, so both sides run the same math; the bench checks their step-1 losses agree.
Reported per side: median step time after warm-up, ours/native, peak memory per rank (growth of
the process's max RSS during the run, the max over ranks: CPU tensors have no allocator counter),
and comm bytes per rank per step (ours: counted by ``shardings.accounting``; native: the ring
volume its collectives must move, 2(n-1)/n·4P for DDP, 3(n-1)/n·4P for FSDP2).
``tp+sp`` and ``zero3+tp+sp`` against ``parallelize_module`` are not here yet: the gpt model has
no ``nn.Linear`` modules for Colwise/Rowwise plans to attach to.
"""

from __future__ import annotations

import argparse
import csv
import functools
import resource
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import core
import models.gpt as gpt
import shardings
from core import tree

_CONFIGS = {
    "gpt_small": dict(vocab=2048, dim=256, layers=4, heads=8, mlp=768, seq_len=128),
    "quick": dict(vocab=64, dim=32, layers=1, heads=4, mlp=64, seq_len=16),
}
_NATIVE = {"dp": "DDP", "zero3": "FSDP2"}


class _Gpt(nn.Module):
    """The gpt parameter tree as ``nn.Parameter`` leaves; ``forward`` is ``gpt.loss`` on them."""

    def __init__(self, params: dict, cfg: gpt.Config):
        super().__init__()
        leaves, self._treedef = tree.flatten(params)
        self.cfg = cfg
        self.leaves = nn.ParameterList([nn.Parameter(x.detach().clone()) for x in leaves])

    def forward(self, batch: dict) -> torch.Tensor:
        # FSDP2 swaps unsharded parameters into the list before forward, so read them here.
        return gpt.loss(tree.unflatten(self._treedef, list(self.leaves)), batch, self.cfg)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _timed(step, steps: int, warmup: int) -> tuple[list[float], float]:
    times, first_loss = [], None
    for _ in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
        first_loss = loss if first_loss is None else first_loss
    return times[warmup:], first_loss


def _worker(side: str, layout: str, cfg_kw: dict, batch_size: int, steps: int, warmup: int) -> dict:
    torch.manual_seed(0)
    cfg = gpt.Config(**cfg_kw)
    rss0 = _rss_mb()
    batch = gpt.example_batch(cfg, batch_size)
    n, rank = dist.get_world_size(), dist.get_rank()
    comm = [0]
    if side == "ours":
        mesh = shardings.Mesh(dp=n)
        params = shardings.init(gpt.init, core.random.key(0), cfg, axes=gpt.axes(cfg), layout=layout, mesh=mesh)
        ts = shardings.train_step(functools.partial(gpt.loss, cfg=cfg), core.optim.adamw(1e-3), layout=layout,
                                  mesh=mesh)
        state = [params, ts.init(params)]

        def step() -> float:
            state[0], state[1], m = ts(state[0], state[1], batch)
            comm[0] = m["comm_bytes"]
            return m["loss"]
    else:
        from torch.distributed.fsdp import fully_shard
        from torch.nn.parallel import DistributedDataParallel

        model = _Gpt(gpt.init(core.random.key(0), cfg), cfg)
        four_p = sum(4 * p.numel() for p in model.parameters())
        if layout == "dp":
            model, comm[0] = DistributedDataParallel(model), 2 * (n - 1) * four_p // n
        else:
            fully_shard(model)
            comm[0] = 3 * (n - 1) * four_p // n
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        rows = batch_size // n
        local = {k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()}

        def step() -> float:
            opt.zero_grad(set_to_none=True)
            loss = model(local)
            loss.backward()
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # the global-batch loss (equal token counts per rank)
            return float(mean) / n

    times, loss = _timed(step, steps, warmup)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss0
    return {"times": times, "loss": loss, "peak_mb": peak, "comm_bytes": comm[0]}


def run(pairs: list[str], config: str, batch_size: int, steps: int, warmup: int) -> list[dict]:
    """Run each pair on 4 ranks and return one row per pair (times in ms, memory in MB).

    >>> rows = run(["dp"], "quick", 8, steps=3, warmup=1)  # doctest: +SKIP
    """
    rows = []
    for layout in pairs:
        res = {
            side: shardings.launch(_worker, 4, side, layout, _CONFIGS[config], batch_size, steps, warmup)
            for side in ("ours", "native")
        }
        med = {s: statistics.median(statistics.median(r["times"]) for r in res[s]) * 1e3 for s in res}
        loss = {s: res[s][0]["loss"] for s in res}
        if abs(loss["ours"] - loss["native"]) > 1e-4 * max(1.0, abs(loss["native"])):
            raise RuntimeError(f"bench {layout}: step-1 losses differ: ours {loss['ours']} vs "
                               f"{_NATIVE[layout]} {loss['native']}. Fix: the two sides do not run the same model.")
        rows.append({
            "config": config, "pair": f"{layout} vs {_NATIVE[layout]}", "steps": steps,
            "ours_ms": round(med["ours"], 2), "native_ms": round(med["native"], 2),
            "ratio": round(med["ours"] / med["native"], 3),
            "ours_peak_mb": round(max(r["peak_mb"] for r in res["ours"]), 1),
            "native_peak_mb": round(max(r["peak_mb"] for r in res["native"]), 1),
            "ours_comm_bytes": res["ours"][0]["comm_bytes"], "native_comm_bytes": res["native"][0]["comm_bytes"],
            "loss_ours": round(loss["ours"], 6), "loss_native": round(loss["native"], 6),
        })
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 timed steps (a smoke run)")
    parser.add_argument("--pairs", nargs="+", default=list(_NATIVE), choices=list(_NATIVE))
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side (median reported)")
    parser.add_argument("--batch", type=int, default=8, help="global batch size (rows)")
    parser.add_argument("--csv", default="bench.csv", help="where to write the table")
    args = parser.parse_args(argv)
    config, steps, warmup = ("quick", 3, 1) if args.quick else ("gpt_small", args.steps, 3)
    rows = run(args.pairs, config, args.batch, steps, warmup)
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    with open(args.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    return rows


if __name__ == "__main__":
    main()
