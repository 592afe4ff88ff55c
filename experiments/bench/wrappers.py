"""Our layouts against torch's own wrappers, side by side (a benchmark, not a test).

``python -m experiments.bench [--quick] [--config gpt_small comm] [--pairs dp zero3 tp+sp zero3+tp+sp]
[--jit] [--jit-backend inductor|aot_eager] [--steps 20] [--rounds 2] [--batch N] [--csv bench.csv]`` (the
package's default benchmark; also ``python -m experiments.bench.wrappers``)

Each side runs in its own ``shardings.launch`` (4 real processes; gloo on CPU, nccl on GPU) on the
same ``models.gpt`` weights, global batch, fp32 (bf16 compute in ``zero3/bf16``) and AdamW(1e-3). The torch side is
:class:`experiments.bench.native_gpt.NativeGpt` — the model a PyTorch user writes (``nn.Embedding``,
``nn.Linear``, ``nn.RMSNorm``, ``F.scaled_dot_product_attention``, ``F.cross_entropy``; no shardlab
code) holding the same weights — wrapped the way a PyTorch user would:

=================  ============================  ====================================================
pair (ours)        our mesh                      torch side
=================  ============================  ====================================================
``dp``             ``Mesh(dp=4)``                ``DistributedDataParallel``
``zero3``          ``Mesh(dp=4)``                FSDP2 ``fully_shard`` per block, then the root
``tp+sp``          ``Mesh(tp=4)``                ``parallelize_module`` with torchtitan's plan
                                                 (``native_gpt.tp_plan``) on a 1-D tp mesh, loss_parallel
``zero3+tp+sp``    ``Mesh(dp=2, tp=2)``          that plan on ``mesh["tp"]`` of a (dp=2, tp=2)
                                                 ``init_device_mesh``, then FSDP2 on ``mesh["dp"]``
``zero3/bf16``     ``Mesh(dp=4)``, layout        FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16,
                   ``zero3``, precision          reduce_dtype=fp32)``
                   ``Policy.bf16_mixed()``
``zero3/offload``  ``Mesh(dp=4)``, layout        FSDP2 with ``CPUOffloadPolicy``: it keeps the sharded
                   ``zero3+offload_optimizer     params, their grads and the optimizer state on the
                   +offload_params``             host and steps there, so ours offloads the same roles
``dp/jit``         ``Mesh(dp=4)``, layout ``dp``,  ``DistributedDataParallel`` over the model with each
                   ``train_step(jit=True)``       block's forward ``torch.compile``d (fullgraph)
``zero3/jit``      ``Mesh(dp=4)``, layout         FSDP2 ``fully_shard`` per block over blocks whose
                   ``zero3``, ``jit=True``        forward is ``torch.compile``d (torchtitan's recipe)
``tp+sp/jit``      ``Mesh(tp=4)``, layout         the TP plan, then each block's forward compiled (the
                   ``tp+sp``, ``jit=True``        plan's hooks inside the block traced into its graph)
``zero3+tp+sp``    ``Mesh(dp=2, tp=2)``, layout   the TP plan on ``mesh["tp"]``, each block's forward
``/jit``           ``zero3+tp+sp``, ``jit=True``  compiled, then FSDP2 on ``mesh["dp"]``
=================  ============================  ====================================================

The ``/jit`` pairs (``--jit`` adds them) compare compiled with compiled, the same recipe on both sides: each
block one graph, embeddings, head and FSDP2's/DDP's collectives eager, both sides compiled by ``--jit-backend``
(:mod:`experiments.bench.compile_backend`: ``inductor`` by default; ``aot_eager``, quick to compile, is what the
tests run and no speed claim: the ``jit_backend`` column and the header say which ran); the TP plan's collectives
inside a block are in its graph on both sides (functional collectives). The torch side follows torchtitan's order:
parallelize (TP), compile each block, then ``fully_shard``. Ours runs ``models.gpt.stages(cfg)`` as the
loss (its blocks declared). Neither side's first steps are counted (collectives, peak memory: dispatch modes
around compiled code would compile other graphs); the eager pairs' rows give those.

On a CPU-only machine FSDP2's default ``CPUOffloadPolicy()`` (``pin_memory=True``) refuses to shard
(``RuntimeError: Cannot access accelerator device when none is available.`` from ``pin_memory()``), so the
torch side takes ``CPUOffloadPolicy(pin_memory=torch.cuda.is_available())``. There host and device are
one memory: FSDP2's copies to its device are no-ops, while ours still copies (``core.offload``: the code
path and bytes a GPU run has); the ``ours_host_bytes`` column counts them (``d2h``/``h2d`` rows), the torch
side's are not counted (plain ``Tensor.to``, no c10d op).

The bench checks both sides' step-1 losses agree: rtol 1e-4 in fp32, and under bf16 the tolerance rule of
``shardings.testing`` for bf16 (``LOW_PRECISION_ULPS``: the two sides round in different kernels).
Reported per side (the max over ranks): median step time after warm-up (each side launched ``--rounds``
times, alternated: on a shared machine the speed drifts by more than some of the gaps measured), ours/native; **peak
memory**: the most bytes live tensors held at once during one warm-up step, the parameters and
optimizer state included (:func:`shardings.peak_memory`, what
``torch.cuda.max_memory_allocated`` reports on a GPU; CPU tensors have no allocator counter); the
growth of the process's max RSS over the run (code, Python objects and what malloc keeps count there
too: noisy); and comm bytes per rank per step,
*measured* by ``shardings.comms()`` around the first step: it sees DDP's bucket
all-reduces, FSDP2's all-gathers/reduce-scatters and the TP plan's redistributions (all reach the
dispatcher as c10d ops). Both counters are dispatch modes, so neither sees inside an op DTensor
dispatches: the torch side's ``loss_parallel`` all-reduces of a few floats per token (~0.1% of
gpt_small's TP traffic) and such an op's scratch tensors are missed; the same holds for ours.

Configs: ``gpt_small`` (compute-bound on CPU), ``comm`` (wide and short, 4 sequences of 16 tokens:
communication dominates), ``quick`` (``--quick``: a tiny smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import resource
import statistics
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel

import core
import models.gpt as gpt
import shardings
from experiments.bench import compile_backend, native_gpt
from experiments.bench.tables import write_csv
from shardings import PeakMemory, peak_memory
from shardings.testing import LOW_PRECISION_ULPS, tolerance


class _Config(NamedTuple):
    model: dict[str, Any]  # gpt.Config fields
    batch: int  # global batch (rows); divisible by every pair's dp size


_CONFIGS = {
    "gpt_small": _Config(dict(vocab=2048, dim=256, layers=4, heads=8, mlp=768, seq_len=128), 8),
    # ~9M params but 64 tokens per step: moving 36 MB of grads dwarfs the matmuls.
    "comm": _Config(dict(vocab=2048, dim=512, layers=2, heads=8, mlp=1536, seq_len=16), 4),
    "quick": _Config(dict(vocab=64, dim=32, layers=1, heads=4, mlp=64, seq_len=16), 8),
}


class _Pair(NamedTuple):
    native: str  # the torch-native name in the table
    mesh: dict[str, int]  # our mesh's axis sizes (the torch side uses the same dp x tp split)
    layout: str | None = None  # our layout; None: the pair's name
    bf16: bool = False  # ours Policy.bf16_mixed(); torch MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    offload: bool = False  # torch side: FSDP2's CPUOffloadPolicy
    jit: bool = False  # ours train_step(jit=True); torch side each block torch.compile'd before wrapping
    jit_backend: str = compile_backend.DEFAULT  # both sides' torch.compile backend under jit


_PAIRS = {
    "dp": _Pair("DDP", {"dp": 4}),
    "zero3": _Pair("FSDP2", {"dp": 4}),
    "tp+sp": _Pair("parallelize_module", {"tp": 4}),
    "zero3+tp+sp": _Pair("FSDP2+TP", {"dp": 2, "tp": 2}),
    "zero3/bf16": _Pair("FSDP2 MixedPrecisionPolicy(bf16, fp32)", {"dp": 4}, "zero3", bf16=True),
    "zero3/offload": _Pair("FSDP2 CPUOffloadPolicy", {"dp": 4}, "zero3+offload_optimizer+offload_params",
                           offload=True),
}
_JIT_PAIRS = {
    "dp/jit": _Pair("DDP + compiled blocks", {"dp": 4}, "dp", jit=True),
    "zero3/jit": _Pair("FSDP2 + compiled blocks", {"dp": 4}, "zero3", jit=True),
    "tp+sp/jit": _Pair("parallelize_module + compiled blocks", {"tp": 4}, "tp+sp", jit=True),
    "zero3+tp+sp/jit": _Pair("FSDP2+TP + compiled blocks", {"dp": 2, "tp": 2}, "zero3+tp+sp", jit=True),
}
_PAIRS.update(_JIT_PAIRS)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _timed(step, steps: int, warmup: int, measure: bool = True) -> tuple[list[float], float, PeakMemory | None]:
    """Step times after ``warmup`` untimed steps; with ``measure``, the first counts collectives, the second live
    tensor bytes."""
    times, first_loss, mem, measure_at = [], None, None, min(1, warmup - 1) if measure else -1
    for i in range(warmup + steps):
        dist.barrier()
        with peak_memory() if i == measure_at else contextlib.nullcontext() as m:
            start = time.perf_counter()
            loss = step(measure and i == 0)  # counting (collectives, memory) costs time: warm-up steps only
            times.append(time.perf_counter() - start)
        mem = m or mem
        first_loss = loss if first_loss is None else first_loss
    return times[warmup:], first_loss, mem


def spec(pair: str) -> _Pair:
    """``_PAIRS[pair]`` with its layout filled in (the pair's name when not given)."""
    return _PAIRS[pair]._replace(layout=_PAIRS[pair].layout or pair)


def ours_step(pair: _Pair, cfg: gpt.Config, batch: dict, comm: list[int]):
    """``step(count) -> loss``: ``train_step`` on ``pair``'s mesh and layout, its state held inside.

    ``comm``: [collective bytes, host copy bytes] of a step run with ``count``.
    """
    mesh, layout, jit = shardings.Mesh(**pair.mesh), pair.layout, pair.jit
    params = shardings.init(gpt.init, core.random.key(0), cfg, axes=gpt.axes(cfg), layout=layout, mesh=mesh)
    loss_fn = gpt.stages(cfg) if jit else functools.partial(gpt.loss, cfg=cfg)  # jit: its blocks compiled each
    precision = core.precision.Policy.bf16_mixed() if pair.bf16 else None
    ts = shardings.train_step(loss_fn, core.optim.adamw(1e-3), layout=layout, mesh=mesh, donate=True,
                              precision=precision, jit=jit, jit_backend=pair.jit_backend, count_comms=False)
    state = [params, ts.init(params)]

    def step(count: bool) -> float:
        ts.count_comms = count
        state[0], state[1], m = ts(state[0], state[1], batch)
        if count:
            host = sum(r["bytes"] for r in m["comm"] if r["axis"] == "host")  # d2h/h2d copies (offload)
            comm[:] = [m["comm_bytes"] - host, host]
        return m["loss"]

    return step


def _fsdp_policies(pair: _Pair) -> dict[str, Any]:
    """``fully_shard``'s mixed-precision / offload keywords for ``pair``."""
    if pair.bf16:
        return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if pair.offload:  # pinning needs an accelerator: CPUOffloadPolicy() raises on a CPU-only machine
        return {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())}
    return {}


def _wrap_native(model: native_gpt.NativeGpt, pair: _Pair) -> tuple[Any, int]:
    """The torch-native wrapping of ``model`` for ``pair``; returns it and this rank's dp index.

    torchtitan's order: the TP plan, then (``pair.jit``) each block's forward compiled, then FSDP2 or DDP.
    """
    layout, device = pair.layout.split("+offload")[0], next(model.parameters()).device.type
    dp, tp = pair.mesh.get("dp", 1), pair.mesh.get("tp", 1)
    dp_mesh = None
    if tp > 1:
        names = ("dp", "tp") if dp > 1 else ("tp",)
        mesh = init_device_mesh(device, (dp, tp) if dp > 1 else (tp,), mesh_dim_names=names)
        model = native_gpt.parallelize(model, mesh["tp"])
        dp_mesh = mesh["dp"] if dp > 1 else None
    elif layout == "zero3":
        dp_mesh = init_device_mesh(device, (dp,), mesh_dim_names=("dp",))
    if pair.jit:  # each block's forward its own graph (torchtitan's recipe); the wrappers' hooks stay eager
        native_gpt.compile_blocks(model, pair.jit_backend)
    if layout == "dp":
        return DistributedDataParallel(model), dist.get_rank()
    if dp_mesh is not None:  # FSDP2: one all-gather group per block, then the rest (embeddings, norm)
        policies = _fsdp_policies(pair)
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh, **policies)
        fully_shard(model, mesh=dp_mesh, **policies)
    return model, 0 if dp_mesh is None else dp_mesh.get_local_rank()


def native_step(pair: _Pair, cfg: gpt.Config, batch: dict, comm: list[int]):
    """``step(count) -> loss``: :class:`NativeGpt` (``gpt.init``'s weights, on ``batch``'s device) wrapped for
    ``pair`` with ``torch.optim.AdamW``; ``comm`` as :func:`ours_step`'s (host copies not seen)."""
    sizes = pair.mesh
    model = native_gpt.from_params(gpt.init(core.random.key(0), cfg), cfg).to(batch["tokens"].device)
    model, dp_rank = _wrap_native(model, pair)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    rows = len(batch["tokens"]) // sizes.get("dp", 1)
    local = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in batch.items()}
    vocab_parallel = loss_parallel if "tp" in sizes else contextlib.nullcontext

    def step(count: bool) -> float:
        opt.zero_grad(set_to_none=True)
        with shardings.comms() if count else contextlib.nullcontext() as c, vocab_parallel():
            loss = model(local)
            loss.backward()
            opt.step()
        comm[:] = [c.total_bytes(), 0] if count else comm  # host copies: plain Tensor.to, not seen
        mean = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().clone()
        dist.all_reduce(mean)  # the global-batch loss: equal token counts per dp rank, equal losses across tp
        return float(mean) / dist.get_world_size()

    return step


def _worker(side: str, pair: str, cfg_kw: dict, batch_size: int, steps: int, warmup: int, jit_backend: str) -> dict:
    torch.manual_seed(0)
    cfg = gpt.Config(**cfg_kw)
    rss0 = _rss_mb()
    batch = gpt.example_batch(cfg, batch_size)
    comm = [0, 0]
    make = ours_step if side == "ours" else native_step
    step = make(spec(pair)._replace(jit_backend=jit_backend), cfg, batch, comm)
    times, loss, mem = _timed(step, steps, warmup, measure=not _PAIRS[pair].jit)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss0
    peak = mem.peak / 2**20 if mem else float("nan")  # /jit pairs: not measured
    return {"times": times, "loss": loss, "peak_mb": peak, "rss_mb": rss, "comm_bytes": comm[0], "host_bytes": comm[1]}


def same_loss(pair: _Pair, ours: float, native: float) -> bool:
    """fp32: rtol 1e-4; bf16: the tolerance rule at bf16 (the two sides round in different kernels)."""
    if not pair.bf16:
        return abs(ours - native) <= 1e-4 * max(1.0, abs(native))
    tol = tolerance(torch.tensor(native), ulps=LOW_PRECISION_ULPS[torch.bfloat16], dtype=torch.bfloat16)
    return abs(ours - native) <= tol.rtol * abs(native) + tol.atol


def run(pairs: list[str], config: str, batch_size: int | None, steps: int, warmup: int, rounds: int = 1,
        jit_backend: str = compile_backend.DEFAULT) -> list[dict]:
    """Run each pair on 4 ranks and return one row per pair (times in ms, memory in MB).

    ``jit_backend`` compiles both sides of the ``/jit`` pairs (the row's ``jit_backend``; empty for the others).

    With ``rounds > 1`` each side is launched that many times, in the order ours, native, native, ours,
    ... (so a machine that drifts during the run slows both sides alike), and the step time is the
    median over every launch and rank of its median step.

    Raises:
        RuntimeError: the two sides' step-1 losses differ (they do not run the same model).

    >>> rows = run(["tp+sp"], "quick", None, steps=3, warmup=1)  # doctest: +SKIP
    >>> rows[0]["pair"]  # doctest: +SKIP
    'tp+sp vs parallelize_module'
    """
    model_kw, default_batch = _CONFIGS[config]
    batch_size = batch_size or default_batch
    rows = []
    for layout in pairs:
        native = _PAIRS[layout].native
        res: dict[str, list[dict]] = {"ours": [], "native": []}
        for k in range(rounds):
            for side in ("ours", "native") if k % 2 == 0 else ("native", "ours"):
                res[side] += shardings.launch(_worker, 4, side, layout, model_kw, batch_size, steps, warmup,
                                              jit_backend)
        med = {s: statistics.median(statistics.median(r["times"]) for r in res[s]) * 1e3 for s in res}
        loss = {s: res[s][0]["loss"] for s in res}
        if not same_loss(_PAIRS[layout], loss["ours"], loss["native"]):
            raise RuntimeError(
                f"bench {layout} ({config}): step-1 losses differ: ours {loss['ours']} vs {native} "
                f"{loss['native']}. Fix: the two sides do not run the same model."
            )
        rows.append({
            "config": config, "pair": f"{layout} vs {native}",
            "jit_backend": jit_backend if _PAIRS[layout].jit else "", "steps": steps,
            "ours_ms": round(med["ours"], 2), "native_ms": round(med["native"], 2),
            "ratio": round(med["ours"] / med["native"], 3),
            "ours_peak_mb": round(max(r["peak_mb"] for r in res["ours"]), 1),
            "native_peak_mb": round(max(r["peak_mb"] for r in res["native"]), 1),
            "ours_rss_mb": round(max(r["rss_mb"] for r in res["ours"]), 1),
            "native_rss_mb": round(max(r["rss_mb"] for r in res["native"]), 1),
            "ours_comm_bytes": max(r["comm_bytes"] for r in res["ours"]),
            "native_comm_bytes": max(r["comm_bytes"] for r in res["native"]),
            "ours_host_bytes": max(r["host_bytes"] for r in res["ours"]),
            "loss_ours": round(loss["ours"], 6), "loss_native": round(loss["native"], 6),
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 timed steps (a smoke run)")
    parser.add_argument("--pairs", nargs="+", default=[p for p in _PAIRS if p not in _JIT_PAIRS], choices=list(_PAIRS))
    parser.add_argument("--jit", action="store_true",
                        help="add the compiled pairs (dp/jit, zero3/jit, tp+sp/jit, zero3+tp+sp/jit): "
                             "train_step(jit=True) vs compiled blocks")
    compile_backend.add_option(parser)
    parser.add_argument("--config", nargs="+", default=["gpt_small"], choices=["gpt_small", "comm"],
                        help="model configs to run (gpt_small: compute-bound; comm: communication dominates)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side and launch (median reported)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="launches per side, alternated (ours, native, native, ours): step times pooled")
    parser.add_argument("--batch", type=int, default=None, help="global batch size (rows); default per config")
    parser.add_argument("--csv", default="bench.csv", help="where to write the table")
    args = parser.parse_args(argv)
    configs, steps, warmup, rounds = (["quick"], 3, 2, 1) if args.quick else (args.config, args.steps, 3, args.rounds)
    pairs = args.pairs + [p for p in _JIT_PAIRS if args.jit and p not in args.pairs]
    rows = [r for config in configs
            for r in run(pairs, config, args.batch, steps, warmup, rounds, jit_backend=args.jit_backend)]
    cols = list(rows[0])
    if any(r["jit_backend"] for r in rows):
        print(compile_backend.caveat(args.jit_backend))
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    write_csv(args.csv, rows)
    return rows


if __name__ == "__main__":
    main()
