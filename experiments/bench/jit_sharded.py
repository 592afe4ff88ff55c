"""The sharded step on one rank against FSDP2 (``python -m experiments.bench.jit --sharded zero3 zero3+tp+sp``).

Rows added to :mod:`experiments.bench.jit`'s table, all in one process launched alone (``shardings.launch(fn, 1)``:
a 1-rank group, gloo on CPU, nccl on CUDA), on the config's weights (``gpt.init(key 0)``) and batch:

``train_step/<layout>``, ``train_step/<layout>/jit``
    ``shardings.train_step`` on a 1-rank mesh (``Mesh(dp=1)``; ``Mesh(dp=1, tp=1)`` for a layout with tp: the
    DTensor path), eager and with ``jit=True`` (its blocks compiled by ``--jit-backend``: ``gpt.stages``), AdamW,
    ``donate=True``; under ``--precision bf16`` the ``Policy(compute_dtype=bf16)`` of ``Policy.bf16_mixed()``.
``fsdp2``, ``fsdp2/compiled_blocks``
    :class:`~experiments.bench.native_gpt.NativeGpt` with ``fully_shard`` per block and on the root (bf16:
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), ``torch.optim.AdamW``; eager, and with each
    block's forward ``torch.compile``d first (torchtitan's recipe, the same backend): the ``vs_native`` /
    ``vs_compiled`` references.

Both sides are built by :mod:`experiments.bench.wrappers`' ``ours_step`` / ``native_step`` (a ``_Pair`` each)
and timed by :mod:`experiments.bench.rows`, as the single-device rows are (median step after warm-up, graphs,
peak memory on CUDA, MFU). Every row's step-1 loss must match ``fsdp2``'s by the wrappers bench's rule (fp32:
rtol 1e-4; bf16: the tolerance rule at bf16). ``--precision`` defaults to bf16 on CUDA (the issue's table) and
fp32 on the CPU (bf16 matmuls are slow there).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

import core
import models.gpt as gpt
import shardings
from experiments.bench import compile_backend, rows, wrappers

LAYOUTS = ("zero3", "zero3+tp+sp")  # the layouts --sharded takes (their 1-rank meshes below)


def _mesh(layout: str) -> dict[str, int]:
    return {"dp": 1, "tp": 1} if "tp" in layout.split("+") else {"dp": 1}


def _build(make: Any, pair: wrappers._Pair, cfg: gpt.Config, batch: dict) -> Any:
    """``rows._measure``'s ``build``: a wrappers step (state held inside) as ``step(a, b, batch) -> (a, b, loss)``."""

    def build() -> tuple[Any, list]:
        step = make(pair, cfg, batch, [0, 0])
        return (lambda a, b, _batch: (a, b, step(False))), [None, None]

    return build


def _worker(config: str, model_kw: dict, batch_size: int, layouts: list[str], device: str, steps: int, warmup: int,
            peak_tflops: float, bf16: bool, compile: bool, rounds: int, threads: int | None,
            jit_backend: str) -> list[dict]:
    if threads:
        torch.set_num_threads(threads)
    cfg = gpt.Config(**model_kw)
    batch = {k: v.to(device) for k, v in gpt.example_batch(cfg, batch_size).items()}
    pairs = {}
    for layout in layouts:
        ours = wrappers._Pair("", _mesh(layout), layout, bf16=bf16, jit_backend=jit_backend)
        pairs[f"train_step/{layout}"] = (wrappers.ours_step, ours)
        if compile:
            pairs[f"train_step/{layout}/jit"] = (wrappers.ours_step, ours._replace(jit=True))
    fsdp2 = wrappers._Pair("FSDP2", {"dp": 1}, "zero3", bf16=bf16, jit_backend=jit_backend)
    pairs["fsdp2"] = (wrappers.native_step, fsdp2)
    if compile:
        pairs["fsdp2/compiled_blocks"] = (wrappers.native_step, fsdp2._replace(jit=True))
    plan = {name: (_build(make, pair, cfg, batch), contextlib.nullcontext) for name, (make, pair) in pairs.items()}
    results = rows.run_plan(plan, batch, steps, warmup, device, rounds)
    ref = results["fsdp2"]["loss"]
    for name, r in results.items():
        if not wrappers.same_loss(fsdp2, r["loss"], ref):
            raise RuntimeError(
                f"bench.jit --sharded {config}: step-1 loss of {name} is {r['loss']}, fsdp2's {ref}. Fix: the row "
                "does not compute gpt.loss (see experiments/bench/wrappers.py's pairs, which check the same)."
            )
    eager = tuple(n for n in results if not n.endswith(("/jit", "/compiled_blocks")))
    params = gpt.init(core.random.key(0), cfg)
    return rows.table(results, config, device, cfg, params, batch_size * cfg.seq_len, peak_tflops, steps, rounds,
                     eager=eager, jit_backend=jit_backend, native="fsdp2", compiled="fsdp2/compiled_blocks")


def run(config: str, layouts: list[str], device: str, steps: int, warmup: int, peak_tflops: float,
        precision: str | None = None, compile: bool = True, rounds: int = 1, threads: int | None = None,
        jit_backend: str = compile_backend.DEFAULT) -> list[dict]:
    """The sharded rows of ``config`` for ``layouts`` (module docstring), from a 1-process launch; the ``/jit`` and
    ``/compiled_blocks`` rows compiled with ``jit_backend``.

    Raises:
        RuntimeError: a row's step-1 loss differs from ``fsdp2``'s (wrapped in the launch's ``LaunchError``).
    """
    bf16 = (precision or ("bf16" if device == "cuda" else "fp32")) == "bf16"
    backend = "nccl" if device == "cuda" else "gloo"
    args = (config, *rows.CONFIGS[config], layouts, device, steps, warmup, peak_tflops, bf16, compile, rounds, threads,
            jit_backend)
    return shardings.launch(_worker, 1, *args, backend=backend)[0]
