"""Pipeline parallelism measured: stage 0's activation memory, the bubble, step time against dp and zero3.

``python -m experiments.bench.pipeline [--part a|b|c|all] [--config medium|tiny] [--ms 2 4 8 16]
[--microbatch 8] [--steps 5] [--rounds 2] [--batch 64] [--m 8]``

On ``models.gpt`` (``--config``; ``medium`` has 8 blocks, 2 per stage at pp=4):

* **a** — activation memory, simulated ranks (``pipeline.run`` without a mesh): stage 0's ``saved_peak``
  (bytes saved for backward at once, parameters excluded, exact) for GPipe and 1F1B at pp=4 and each
  ``--ms``, microbatches of ``--microbatch`` rows (the batch grows with m). ``ratio`` is the peak over one
  microbatch's (m=1); ``planned`` the schedule's microbatches in flight on rank 0 (``peak_in_flight``).
* **b** — the bubble on 4 real gloo processes (one ``shardings.launch``): per rank the idle fraction
  ``Result.bubble()`` measured from its F/B timestamps (median over ``--steps`` runs after one warm-up),
  their mean, the part of it spent in sends (``in_sends``, mean over ranks; the rest is waiting in receives),
  the formula (p−1)/(m+p−1) and the unit-time ``schedule.bubble()``.
* **c** — step time on 4 gloo processes (one launch), same global batch (``--batch`` rows) and
  AdamW(1e-3) in torch's fused kernel everywhere: ``pp`` is 1F1B with ``--m`` microbatches on
  ``Mesh(pp=4)`` then each rank's update of its own stage's parameters (its blocks; the first and the last
  stage also the embedding, final norm and unembedding); ``dp`` and ``zero3`` are ``shardings.train_step``
  on ``Mesh(dp=4)``. ``pipeline.run`` also lays out its messages (a meta-device run), all-reduces the loss and
  gathers every rank's timeline each call: all counted in pp's time. The bench raises unless the three
  variants' losses agree at step 1 and at step 2 (after one update). A step's time is the slowest rank's (ranks
  start each step at a barrier); the median over ``--steps`` steps × ``--rounds`` rounds (variants alternated)
  after two warm-up steps.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import torch.distributed as dist

import core
import models.gpt as gpt
import shardings
from shardings import default_token_count, pipeline

PP = 4
_CONFIGS = {
    # compute dominates per-message overhead on CPU, and a step still takes about a second on 4 ranks
    "medium": dict(vocab=256, dim=128, layers=8, heads=4, kv_heads=2, seq_len=64, mlp=256),
    "tiny": dict(vocab=64, dim=32, layers=4, heads=4, kv_heads=2, seq_len=8, mlp=64),  # tests
}


def _microbatches(batch: dict, m: int) -> tuple[list[dict], list[float]]:
    """``batch`` in ``m`` row chunks (each its own storage) and their token shares."""
    mbs = [core.tree.map(lambda x, i=i: x.chunk(m)[i].clone(), batch) for i in range(m)]
    total = default_token_count(batch)
    return mbs, [float(default_token_count(mb) / total) for mb in mbs]


def _run(schedule: str, cfg: gpt.Config, params: Any, inputs: tuple[list[dict], list[float]],
         mesh: Any = None) -> pipeline.Result:
    mbs, weights = inputs
    return pipeline.run(pipeline.build(schedule, PP, len(mbs)), gpt.stages(cfg), pipeline.split(params, PP), params,
                        mbs, weights, mesh=mesh)


def memory(cfg_kw: dict, ms: list[int], rows: int) -> list[dict]:
    """(a) Stage 0's saved-activation peak per schedule and m (simulated ranks)."""
    cfg = gpt.Config(**cfg_kw)
    params = gpt.init(core.random.key(0), cfg)
    inputs = {m: _microbatches(gpt.example_batch(cfg, m * rows), m) for m in {1, *ms}}
    one = _run("gpipe", cfg, params, inputs[1]).saved_peak[0]
    peaks = {(s, m): _run(s, cfg, params, inputs[m]).saved_peak[0] for s in ("gpipe", "1f1b") for m in ms}
    return [{"schedule": s, "m": m, "batch_rows": m * rows, "stage0_peak_bytes": peak, "one_microbatch_bytes": one,
             "ratio": round(peak / one, 3), "planned": pipeline.build(s, PP, m).peak_in_flight()[0]}
            for (s, m), peak in peaks.items()]


def _send_share(result: pipeline.Result) -> float:
    """Time in sends (packing the byte buffer, posting the isend) over the run's span, mean over ranks: idle by
    ``Result.bubble()``'s count (not F or B) but not waiting; the rest of the idle time is waiting in receives."""
    t0, t1 = min(t.start for t in result.timeline), max(t.end for t in result.timeline)
    return sum(t.end - t.start for t in result.timeline if t.action.kind.startswith("SEND")) / (PP * (t1 - t0))


def _bubble_worker(cfg_kw: dict, ms: list[int], rows: int, steps: int) -> dict:
    cfg, mesh = gpt.Config(**cfg_kw), shardings.Mesh(pp=PP)
    params = gpt.init(core.random.key(0), cfg)
    out = {}
    for s in ("gpipe", "1f1b"):
        for m in ms:
            inputs, runs = _microbatches(gpt.example_batch(cfg, m * rows), m), []
            for _ in range(1 + steps):  # the first is warm-up
                dist.barrier()
                result = _run(s, cfg, params, inputs, mesh)
                runs.append([*result.bubble(), _send_share(result)])
            out[s, m] = [statistics.median(r[k] for r in runs[1:]) for k in range(PP + 1)]  # per rank, sends
    return out


def bubble(cfg_kw: dict, ms: list[int], rows: int, steps: int) -> list[dict]:
    """(b) Each rank's measured idle fraction on 4 gloo processes, beside the formula and the plan."""
    measured = shardings.launch(_bubble_worker, PP, cfg_kw, ms, rows, steps)[0]  # every rank gathers all
    rows_out = []
    for (s, m), (*per_rank, sends) in measured.items():
        rows_out.append({"schedule": s, "m": m, **{f"rank{r}": round(b, 3) for r, b in enumerate(per_rank)},
                         "mean": round(statistics.mean(per_rank), 3), "in_sends": round(sends, 3),
                         "formula": round((PP - 1) / (m + PP - 1), 3),
                         "planned": round(pipeline.build(s, PP, m).bubble(), 3)})
    return rows_out


def _own(tree: dict, split: pipeline.Split, rank: int) -> dict:
    """The part of a params-like tree that ``rank``'s stage updates (``pipeline.run``'s stage leaves).

    Untied embeddings (both configs): a tied one would need its first and last stage's gradients summed first.
    """
    mine = {"blocks": [tree["blocks"][i] for i in split.ranges[rank]]}
    edge = {k: v for k, v in tree.items() if k != "blocks"} if rank in (0, split.stages - 1) else {}
    return {**mine, **edge}


def _pp_step(cfg: gpt.Config, batch: dict, m: int, opt: Any):
    mesh = shardings.Mesh(pp=PP)
    rank = mesh.device_mesh.get_local_rank("pp")
    params = gpt.init(core.random.key(0), cfg)
    split, schedule, stages = pipeline.split(params, PP), pipeline.build("1f1b", PP, m), gpt.stages(cfg)
    mbs, weights = _microbatches(batch, m)
    state = [params, opt.init(_own(params, split, rank))]

    def step() -> float:
        result = pipeline.run(schedule, stages, split, state[0], mbs, weights, mesh=mesh)
        # fused AdamW writes into the parameters' buffers: state[0] is updated in place
        _, state[1] = opt.fused_step(_own(result.grads, split, rank), state[1], _own(state[0], split, rank))
        return float(result.loss)

    return step


def _layout_step(layout: str, cfg: gpt.Config, batch: dict, opt: Any):
    mesh = shardings.Mesh(dp=PP)
    params = shardings.init(gpt.init, core.random.key(0), cfg, axes=gpt.axes(cfg), layout=layout, mesh=mesh)
    ts = shardings.train_step(functools.partial(gpt.loss, cfg=cfg), opt, layout=layout, mesh=mesh, count_comms=False,
                              donate=True)
    state = [params, ts.init(params)]

    def step() -> float:
        state[0], state[1], metrics = ts(state[0], state[1], batch)
        return metrics["loss"]

    return step


def _step_worker(cfg_kw: dict, batch_rows: int, m: int, steps: int, rounds: int) -> dict[str, dict[str, list]]:
    """Per variant: step times after warm-up, and the first two steps' losses (the second after one update)."""
    cfg = gpt.Config(**cfg_kw)
    batch, opt = gpt.example_batch(cfg, batch_rows), core.optim.adamw(1e-3)
    variants = {"pp": _pp_step(cfg, batch, m, opt), **{v: _layout_step(v, cfg, batch, opt) for v in ("dp", "zero3")}}
    out: dict[str, dict[str, list]] = {v: {"times": [], "losses": []} for v in variants}
    for k in range(rounds):
        for v in list(variants)[:: 1 if k % 2 == 0 else -1]:
            for i in range((2 if k == 0 else 0) + steps):  # two warm-up steps in the first round
                dist.barrier()
                start = time.perf_counter()
                loss = variants[v]()
                if k == 0 and i < 2:
                    out[v]["losses"].append(loss)
                else:
                    out[v]["times"].append(time.perf_counter() - start)
    return out


def step_time(cfg_kw: dict, batch_rows: int, m: int, steps: int, rounds: int) -> list[dict]:
    """(c) Median step ms of pp (1F1B), dp and zero3 on 4 gloo processes, and pp's ratios to the others.

    Raises:
        RuntimeError: the variants' losses at step 1 or step 2 (after one update) differ: they do not train the
            same model on the same batch.
    """
    per_rank = shardings.launch(_step_worker, PP, cfg_kw, batch_rows, m, steps, rounds)
    ms = {v: statistics.median(max(ts) for ts in zip(*(r[v]["times"] for r in per_rank))) * 1e3 for v in per_rank[0]}
    losses = {v: per_rank[0][v]["losses"] for v in ms}
    for v, got in losses.items():
        if any(abs(a - b) > 1e-4 * max(1.0, abs(b)) for a, b in zip(got, losses["dp"])):
            raise RuntimeError(f"bench.pipeline (c): {v}'s losses at steps 1, 2 are {got}, dp's {losses['dp']}. "
                               "Fix: the variants must train the same model on the same batch.")
    return [{"variant": v, "mesh": "pp=4, 1f1b" if v == "pp" else "dp=4", "batch_rows": batch_rows,
             "microbatches": m if v == "pp" else 1, "step_ms": round(t, 1), "pp_over_this": round(ms["pp"] / t, 3),
             "loss_step2": round(losses[v][1], 6)} for v, t in ms.items()]


def _print(title: str, rows: list[dict]) -> None:
    cols = list(rows[0])
    print(f"\n{title}\n\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")


def main(argv: list[str] | None = None) -> dict[str, list[dict]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["a", "b", "c", "all"], default="all")
    parser.add_argument("--config", choices=list(_CONFIGS), default="medium", help="models.gpt size")
    parser.add_argument("--ms", type=int, nargs="+", default=None,
                        help="microbatch counts for a and b (default a: 2 4 8 16, b: 4 8 16)")
    parser.add_argument("--microbatch", type=int, default=8,
                        help="rows per microbatch in a and b (8 x 64 tokens: compute dominates per-message cost)")
    parser.add_argument("--steps", type=int, default=5, help="timed runs per measurement (b: per m; c: per round)")
    parser.add_argument("--rounds", type=int, default=2, help="c: rounds, variants alternated (pp dp zero3 ...)")
    parser.add_argument("--batch", type=int, default=64, help="c: global batch rows (divisible by 4 and --m)")
    parser.add_argument("--m", type=int, default=8, help="c: the pipeline's microbatches")
    args = parser.parse_args(argv)
    cfg_kw, parts, out = _CONFIGS[args.config], "abc" if args.part == "all" else args.part, {}
    if "a" in parts:
        out["a"] = memory(cfg_kw, args.ms or [2, 4, 8, 16], args.microbatch)
        _print(f"(a) stage 0 saved activations, pp={PP}, {args.microbatch} rows per microbatch", out["a"])
    if "b" in parts:
        out["b"] = bubble(cfg_kw, args.ms or [4, 8, 16], args.microbatch, args.steps)
        _print(f"(b) measured bubble per rank, pp={PP} gloo processes, {args.microbatch} rows per microbatch", out["b"])
    if "c" in parts:
        out["c"] = step_time(cfg_kw, args.batch, args.m, args.steps, args.rounds)
        _print(f"(c) step time on 4 gloo processes, batch {args.batch} rows", out["c"])
    return out


if __name__ == "__main__":
    main()
