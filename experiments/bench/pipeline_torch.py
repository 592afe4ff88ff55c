"""Our pipeline schedules against ``torch.distributed.pipelining`` on 4 gloo processes, pair by pair.

``python -m experiments.bench.pipeline_torch [--config medium|tiny] [--m 8] [--microbatch 8] [--steps 5]``

Pairs: ``gpipe``/``ScheduleGPipe`` and ``1f1b``/``Schedule1F1B`` on 4 stages (rank r: stage r), and
``interleaved_1f1b``/``ScheduleInterleaved1F1B`` (rank r: stages r, r + 4) and ``zb_v``/``ScheduleZBVZeroBubble``
(rank r: stages r, 7 − r) on 8 stages, all of ``models.gpt`` (``--config``, with 8 blocks). Both sides
start from the same weights (torch's stages are ``experiments.bench.native_gpt`` modules built from our parameters:
``nn.Embedding``, ``nn.Linear``, ``nn.RMSNorm``, SDPA, ``F.cross_entropy``) and run the same ``--m``
microbatches of ``--microbatch`` rows. What a step is, on both sides: the forwards and backwards of every
microbatch (gradients left on each rank's own stages), no optimizer. Per pair, one launch, sides alternated:

* ``step_ms``: median over ``--steps`` of the slowest rank's time (ranks start at a barrier), after a warm-up;
  ``ours_over_torch`` their ratio;
* ``saved_peak_mb``: the most bytes of activations saved for backward at once on a rank (parameters excluded),
  max over ranks, counted by the same ``saved_tensors_hooks`` on both sides (CPU has no allocator peak);
* ``bubble``: mean over ranks of 1 − (the rank's F, B, W time) / (first start to last end over all ranks);
  ours from ``Result.bubble()``, torch's from timing its stages' ``forward_one_chunk``, ``backward_one_chunk``
  and ``backward_weight_one_chunk``; ``planned`` our schedule's unit-time bubble;
* ``loss``: both sides' step-1 loss (the mean over microbatches); the bench raises unless they agree to 1e-5.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import pipelining as tp

import core
import models.gpt as gpt
import shardings
from experiments.bench import native_gpt
from experiments.bench.pipeline import _CONFIGS, PP, _microbatches, _print
from shardings import pipeline

PAIRS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
         "zb_v": "ScheduleZBVZeroBubble"}


class _Stage(nn.Module):
    """Blocks ``blocks`` of a ``NativeGpt``, with the embedding on the first stage and the head on the last."""

    def __init__(self, model: native_gpt.NativeGpt, blocks: range):
        super().__init__()
        self.cfg, self.first, self.last = model.cfg, blocks.start == 0, blocks.stop == model.cfg.layers
        self.embed = model.embed if self.first else None
        self.blocks = nn.ModuleList(model.blocks[i] for i in blocks)
        self.final_norm, self.unembed = (model.final_norm, model.unembed) if self.last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) if self.first else x  # tokens (batch, seq) -> (batch, seq, dim)
        cos, sin = native_gpt.rope_tables(x.shape[1], self.cfg.d_head, self.cfg.rope_theta, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.unembed(self.final_norm(x)) if self.last else x  # (batch, seq, vocab) on the last


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def _placement(name: str) -> list[int]:
    """Our schedule's stage -> rank (torch's stages go where ours do)."""
    return [pipeline.build(name, PP, PP).rank_of(s) for s in range(pipeline.build(name, PP, PP).stages)]


def _timed(stage: Any, busy: list[tuple[float, float]]) -> None:
    """Record the start and end of each compute of ``stage`` (torch's F, B and W) into ``busy``."""
    for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        inner = getattr(stage, method)

        def timed(*args: Any, _inner: Any = inner, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return _inner(*args, **kw)
            finally:
                busy.append((start, time.perf_counter()))

        setattr(stage, method, timed)


def _bubble(busy: list[tuple[float, float]]) -> float:
    """Mean over ranks of 1 − busy / span, span from every rank's first start to the last end."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, busy)
    t0, t1 = min(s for b in every for s, _ in b), max(e for b in every for _, e in b)
    return statistics.mean(1 - sum(e - s for s, e in b) / (t1 - t0) for b in every)


def _torch_side(name: str, cfg: gpt.Config, params: Any, mbs: list[dict]):
    rank, placement = dist.get_rank(), _placement(name)
    split = pipeline.split(params, len(placement))
    model = native_gpt.from_params(params, cfg)
    mine = [s for s, r in enumerate(placement) if r == rank]
    stages = [tp.PipelineStage(_Stage(model, split.ranges[s]), s, len(placement), torch.device("cpu"))
              for s in mine]
    busy: list[tuple[float, float]] = []
    for st in stages:
        _timed(st, busy)
    kind = getattr(tp, PAIRS[name])
    schedule = kind(stages if len(stages) > 1 else stages[0], len(mbs), loss_fn=_loss)
    tokens = torch.cat([mb["tokens"] for mb in mbs])
    labels = torch.cat([mb["labels"] for mb in mbs])

    def step() -> dict:
        model.zero_grad(set_to_none=True)
        busy.clear()
        saved, losses = pipeline.SavedActivations(1, list(model.parameters())), []
        args = (tokens,) if 0 in mine else ()
        kw = {"target": labels, "losses": losses} if len(placement) - 1 in mine else {}
        with saved.hooks(0):
            schedule.step(*args, **kw)
        loss = torch.stack(losses).detach().mean() if losses else torch.zeros(())
        dist.all_reduce(loss)  # only the last stage's rank has it
        return {"loss": float(loss), "bubble": _bubble(busy), "saved_peak": saved.peak[0]}

    return step


def _our_side(name: str, cfg: gpt.Config, params: Any, mbs: list[dict]):
    schedule, weights = pipeline.build(name, PP, len(mbs)), [1 / len(mbs)] * len(mbs)
    split, mesh = pipeline.split(params, schedule.stages), shardings.Mesh(pp=PP)
    stages = gpt.stages(cfg)  # built once, as a training loop does: run() caches its message layouts per stages

    def step() -> dict:
        result = pipeline.run(schedule, stages, split, params, mbs, weights, mesh=mesh)
        return {"loss": float(result.loss), "bubble": statistics.mean(result.bubble()),
                "saved_peak": max(result.saved_peak)}

    return step


def _worker(name: str, cfg_kw: dict, m: int, rows: int, steps: int) -> dict[str, list[dict]]:
    cfg = gpt.Config(**cfg_kw)
    params = gpt.init(core.random.key(0), cfg)
    mbs, _ = _microbatches(gpt.example_batch(cfg, m * rows), m)  # no ignored labels: equal token shares
    sides = {"ours": _our_side(name, cfg, params, mbs), "torch": _torch_side(name, cfg, params, mbs)}
    out: dict[str, list[dict]] = {side: [] for side in sides}
    for k in range(1 + steps):  # the first is warm-up (and step 1's loss)
        for side in list(sides)[:: 1 if k % 2 == 0 else -1]:
            dist.barrier()
            start = time.perf_counter()
            found = sides[side]()
            found["seconds"] = time.perf_counter() - start
            out[side].append(found)
    return out


def compare(name: str, cfg_kw: dict, m: int, rows: int, steps: int) -> dict:
    """One pair on 4 gloo processes (module docstring); raises unless the two step-1 losses agree."""
    per_rank = shardings.launch(_worker, PP, name, cfg_kw, m, rows, steps)
    ms = {side: statistics.median(max(r[side][k]["seconds"] for r in per_rank) for k in range(1, 1 + steps)) * 1e3
          for side in ("ours", "torch")}
    first = {side: per_rank[0][side][0]["loss"] for side in ms}
    if abs(first["ours"] - first["torch"]) > 1e-5 * max(1.0, abs(first["torch"])):
        raise RuntimeError(f"bench.pipeline_torch {name}: step-1 losses differ, ours {first['ours']}, torch "
                           f"{first['torch']}. Fix: both sides must run the same model, weights and microbatches.")
    row: dict[str, Any] = {"ours": name, "torch": PAIRS[name], "m": m}
    for side in ms:
        runs = [r[side][k] for r in per_rank for k in range(1, 1 + steps)]
        row[f"{side}_ms"] = round(ms[side], 1)
        row[f"{side}_saved_peak_mb"] = round(max(x["saved_peak"] for x in runs) / 2**20, 2)
        row[f"{side}_bubble"] = round(statistics.median(x["bubble"] for x in runs), 3)
    row["ours_over_torch"] = round(ms["ours"] / ms["torch"], 3)
    row["planned"] = round(pipeline.build(name, PP, m).bubble(), 3)
    row["loss_ours"], row["loss_torch"] = round(first["ours"], 6), round(first["torch"], 6)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=list(_CONFIGS), default="medium", help="models.gpt size")
    parser.add_argument("--m", type=int, default=8, help="microbatches (a multiple of 4 for the interleaved pair)")
    parser.add_argument("--microbatch", type=int, default=8, help="rows per microbatch")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per side after one warm-up")
    parser.add_argument("--pairs", nargs="+", choices=list(PAIRS), default=list(PAIRS))
    args = parser.parse_args(argv)
    cfg_kw = {**_CONFIGS[args.config], "layers": 2 * PP}  # one block per stage on 8 stages
    rows = [compare(name, cfg_kw, args.m, args.microbatch, args.steps) for name in args.pairs]
    _print(f"ours vs torch.distributed.pipelining, {PP} gloo processes, m={args.m}, {args.microbatch} rows per "
           "microbatch", rows)
    return rows


if __name__ == "__main__":
    main()
