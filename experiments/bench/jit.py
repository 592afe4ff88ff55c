"""A whole single-device train step: shardlab eager and ``core.jit`` against a torch-native anchor (a benchmark).

``python -m experiments.bench.jit [--configs tiny gpt_small] [--device cpu|cuda] [--steps 20]
[--warmup 3] [--rounds 1] [--peak-tflops 989] [--as-is] [--no-compile] [--threads N] [--csv bench_jit.csv]
[--sharded zero3 zero3+tp+sp] [--precision bf16|fp32] [--jit-backend inductor|aot_eager]``

Rows, all on the same shapes, weights (``gpt.init(key 0)``) and batch, one after another in one process:

``eager``
    shardlab: ``core.value_and_grad(gpt.loss)`` + ``core.optim.adamw``'s ``fused_step`` on plain tensors
    (:func:`make_step` with ``donate=True``: torch's fused AdamW kernel in place, as ``train_step(donate=True)``
    runs it and as the native row's optimizer does).
``jit``
    that whole step under ``core.jit`` (``--jit-backend``; inductor's CPU code needs a C++ compiler) as
    **one graph** — forward, backward and the pure optimizer update (``update`` + ``apply_updates``) — under
    :func:`whole_step_tracing`, which
    lifts the two graph breaks a plain ``core.jit(step)`` hits (``--as-is`` adds that row,
    ``jit_as_is``, with its graph count):

    1. ``torch.autograd.grad`` (inside ``core.value_and_grad``) is a graph break unless
       ``torch._dynamo.config.trace_autograd_ops`` is on; the break then also splits the graph at every
       ``requires_grad_()`` leaf;
    2. ``shardings.constrain`` (called by the models) reads a ``ContextVar``, which dynamo cannot
       trace: one graph break per call. With no mesh active its answer is ``None``, so it is marked
       constant while the step compiles (checked: no mesh may be active).
``native``
    the anchor: :class:`experiments.bench.native_gpt.NativeGpt` — ``nn.Linear``/``nn.RMSNorm`` modules,
    ``F.scaled_dot_product_attention``, ``F.cross_entropy``, no shardlab code — with
    ``torch.optim.AdamW(fused=True)`` at the same lr, betas, eps and weight decay; the loop a PyTorch
    user writes (forward, ``backward()``, ``opt.step()``, ``zero_grad``) (:func:`make_native_step`).
``native_compile``
    the same with ``torch.compile(model)`` (forward and backward compiled; the fused optimizer eager).

``--no-compile`` leaves out the compiled rows (``jit``, ``jit_as_is``, ``native_compile``). ``--jit-backend``
compiles every compiled row, ours and torch's, with one backend (:mod:`experiments.bench.compile_backend`:
``inductor`` by default; ``aot_eager``, what the tests run, compiles in seconds but is no speed claim); the
header line and the CSV's ``jit_backend`` column (empty on eager rows) say which ran.

``--sharded LAYOUT ...`` adds, per config, the sharded step on one rank against FSDP2 on one rank
(:mod:`experiments.bench.jit_sharded`: ``train_step/<layout>``, ``train_step/<layout>/jit``, ``fsdp2``,
``fsdp2/compiled_blocks``; their ``vs_native`` / ``vs_compiled`` are multiples of the two ``fsdp2`` rows).

Reported per row: median step time after warm-up (pooled over ``--rounds`` builds of every row,
alternated: on a shared machine the speed drifts by more than some of the gaps measured), tokens/s,
the step time as a multiple of the native rows' (``vs_native``, ``vs_compiled``: > 1 is slower than
torch), the compile time (the first call: compile + one step; inductor's on-disk cache makes a repeat
run's shorter), dynamo's graph count and the step-1 loss. Every row's step-1 loss must equal
``eager``'s by ``shardings.testing``'s tolerance rule (fp32, the batch's tokens as terms). On
``--device cuda`` the step runs under bf16 autocast (fp32 master params and optimizer state) and
the table adds the peak memory of each row (``torch.cuda.max_memory_allocated`` above what was
allocated before the row built its state), its multiples of the native rows' and MFU =
(6·N + 12·layers·heads·head_dim·seq_len) · tokens/s / peak, with N the params outside the input
embedding (a lookup, no FLOPs) and the attention term PaLM's (appendix B).

Configs: ``tiny`` (seconds to compile), ``gpt_small`` (as experiments/bench/wrappers.py), ``gpt_650m``
(for a GPU: ~0.65B params, seq 2048).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

import core
import models.gpt as gpt
import shardings
from core import optim, tree
from experiments.bench import compile_backend, jit_sharded, native_gpt
from experiments.bench.rows import CONFIGS, Step, run_plan, table
from experiments.bench.tables import write_csv
from shardings.testing import diff

# Both sides' AdamW: core.optim.adamw and torch.optim.AdamW with these hyperparameters.
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01



def _autocast(device: str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return torch.autocast(device, dtype=dtype) if dtype else contextlib.nullcontext()


def make_step(cfg: gpt.Config, opt: optim.GradientTransformation, autocast: torch.dtype | None = None,
              donate: bool = False) -> Step:
    """``step(params, opt_state, batch) -> (params, opt_state, loss)``: grad, AdamW update, apply.

    ``donate=True`` updates params and state in place by ``opt.fused_step`` (eager only: a compiled step
    keeps the pure update).

    >>> cfg = gpt.Config(layers=1)
    >>> step = make_step(cfg, optim.adamw(1e-3))
    >>> params = gpt.init(core.random.key(0), cfg)
    >>> params, state, loss = step(params, optim.adamw(1e-3).init(params), gpt.example_batch(cfg, 2))
    """

    def loss_fn(params: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with _autocast(batch["tokens"].device.type, autocast):
            return gpt.loss(params, batch, cfg)

    # Built once, outside the step: functools.wraps inside value_and_grad is itself a graph break.
    value_and_grad = core.value_and_grad(loss_fn)

    def step(params: Any, opt_state: Any, batch: dict[str, torch.Tensor]) -> tuple[Any, Any, torch.Tensor]:
        loss, grads = value_and_grad(params, batch)
        if donate:
            params, opt_state = opt.fused_step(grads, opt_state, params)
            return params, opt_state, loss
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    return step


def make_native_step(autocast: torch.dtype | None = None) -> Step:
    """``step(model, opt, batch) -> (model, opt, loss)``: a PyTorch user's training step, in place.

    >>> cfg = gpt.Config(layers=1); model = native_gpt.NativeGpt(cfg)
    >>> opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    >>> model, opt, loss = make_native_step()(model, opt, gpt.example_batch(cfg, 2))
    """

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> tuple:
        with _autocast(batch["tokens"].device.type, autocast):
            loss = model(batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return model, opt, loss.detach()

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


def run(
    config: str,
    device: str,
    steps: int,
    warmup: int,
    peak_tflops: float,
    as_is: bool = False,
    compile: bool = True,
    rounds: int = 1,
    jit_backend: str = compile_backend.DEFAULT,
) -> list[dict]:
    """Time ``config``'s rows (see the module docstring) on ``device``; one dict per row.

    With ``rounds > 1`` every row is built and timed that many times, in alternated order (rows
    a, b, c, then c, b, a, ...: a machine that drifts slows every row alike), and its step time is
    the median over all its rounds' steps. ``jit_backend`` compiles the ``jit`` rows and ``native_compile``.

    Raises:
        RuntimeError: a row's step-1 loss differs from ``eager``'s past the tolerance rule.
    """
    model_kw, batch_size = CONFIGS[config]
    cfg = gpt.Config(**model_kw)
    params = gpt.init(core.random.key(0), cfg)  # on the CPU: each row copies it to the device
    batch = {k: v.to(device) for k, v in gpt.example_batch(cfg, batch_size).items()}
    autocast = torch.bfloat16 if device == "cuda" else None
    opt = optim.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
    step, native_step = make_step(cfg, opt, autocast), make_native_step(autocast)
    donating = make_step(cfg, opt, autocast, donate=True)

    def ours() -> list:
        copy = tree.map(lambda p: p.to(device, copy=True), params)
        return [copy, opt.init(copy)]

    def native(wrap: Callable = lambda m: m) -> list:
        model = native_gpt.from_params(params, cfg).to(device)
        torch_opt = torch.optim.AdamW(
            model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True
        )
        return [wrap(model), torch_opt]

    none = contextlib.nullcontext
    plan = {  # name -> (build: () -> (step, state), tracing context), run in this order
        "eager": (lambda: (donating, ours()), none),
        "native": (lambda: (native_step, native()), none),
    }
    if compile:
        jitted = functools.partial(core.jit, backend=jit_backend)
        compiled = functools.partial(torch.compile, backend=jit_backend)
        plan["jit"] = (lambda: (jitted(step), ours()), whole_step_tracing)
        plan["native_compile"] = (lambda: (native_step, native(compiled)), none)
        if as_is:
            plan["jit_as_is"] = (lambda: (jitted(step), ours()), none)
    results = run_plan(plan, batch, steps, warmup, device, rounds)
    tokens = batch_size * cfg.seq_len
    eager = results["eager"]
    for name, r in results.items():
        d = diff(torch.tensor(r["loss"]), torch.tensor(eager["loss"]), terms=tokens)
        if not d.ok:
            raise RuntimeError(
                f"bench.jit {config}: step-1 loss of {name} is {r['loss']}, eager's {eager['loss']} "
                f"({d.used:.1f}x the tolerance rule's allowance for {tokens} tokens). Fix: the row does not compute "
                "gpt.loss (for a compiled row, bisect with --jit-backend aot_eager; for a native row, test_native_gpt)."
            )
    return table(results, config, device, cfg, params, tokens, peak_tflops, steps, rounds, eager=("eager", "native"),
                 jit_backend=jit_backend)


def _print_table(rows: list[dict], cols: list[str]) -> None:
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    print(" | ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print(" | ".join(str(r[c]).rjust(w) for c, w in zip(cols, widths)))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["tiny", "gpt_small"], choices=list(CONFIGS))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per row (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first one compiles)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="peak bf16 TFLOP/s for MFU (H100 SXM: 989)")
    parser.add_argument("--as-is", action="store_true", help="also time core.jit(step) without whole_step_tracing")
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time the compiled rows (core.jit, torch.compile); --no-compile leaves them out",
    )
    parser.add_argument("--rounds", type=int, default=1, help="times each row is built and timed, alternated")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--csv", default="bench_jit.csv", help="where to write the table")
    parser.add_argument("--sharded", nargs="+", default=[], choices=jit_sharded.LAYOUTS,
                        help="add train_step on one rank under these layouts vs FSDP2 on one rank (jit_sharded)")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default=None,
                        help="the --sharded rows' precision (default: bf16 on cuda, fp32 on cpu)")
    compile_backend.add_option(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    run_one = functools.partial(
        run,
        device=args.device,
        steps=args.steps,
        warmup=max(args.warmup, 1),
        peak_tflops=args.peak_tflops,
        as_is=args.as_is,
        compile=args.compile,
        rounds=args.rounds,
        jit_backend=args.jit_backend,
    )
    sharded = functools.partial(jit_sharded.run, layouts=args.sharded, device=args.device, steps=args.steps,
                                warmup=max(args.warmup, 1), peak_tflops=args.peak_tflops, precision=args.precision,
                                compile=args.compile, rounds=args.rounds, threads=args.threads,
                                jit_backend=args.jit_backend)
    rows = [r for c in args.configs for r in run_one(c) + (sharded(c) if args.sharded else [])]
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {args.device}, {threads} threads, median of {args.rounds}x{args.steps} steps")
    if args.compile:
        print(compile_backend.caveat(args.jit_backend))
    cols = ["config", "variant", "step_ms", "tokens_per_s", "vs_native", "vs_compiled", "compile_s", "graphs", "loss"]
    if args.device == "cuda":
        cols[6:6] = ["peak_mb", "mem_vs_native", "mem_vs_compiled", "mfu"]
    _print_table(rows, cols)
    write_csv(args.csv, rows)
    return rows


if __name__ == "__main__":
    main()
