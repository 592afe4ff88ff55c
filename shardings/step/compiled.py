"""``train_step(..., jit=True)``: the sharded step with its model compute compiled, torchtitan's recipe.

What is compiled is the model, block by block, not the step: when the loss declares its blocks (a
:class:`~shardings.pipeline.Stages`, ``models.gpt.stages(cfg)``) each block call runs one ``torch.compile``d
graph (the same graph for every block of the same shapes); a loss that declares no blocks is compiled whole.
Everything around the graphs stays eager, as FSDP2's hooks stay eager around torchtitan's compiled blocks: the
local path's bucketed all-gathers, reduce-scatters and all-reduces (:mod:`shardings.step.local_step`) are launched
from the same hooks, at the same points of backward, so they overlap with it exactly as in the eager step.

On the DTensor path (tp, sp, cp, ep and their compositions with the data-parallel presets) the block's DTensor ops
are traced: its tp/sp/cp/ep collectives (``constrain``'s redistributions, ring attention's and MoE dispatch's
``shard_map`` collectives) become functional collectives inside the graph, as torch's DTensor compile support lowers
them (torchtitan's compiled TP blocks).

What makes a block traceable:

- the active mesh lookup: :func:`shardings.spec.context.current` reads a dynamo-visible global while tracing;
- ZeRO-3's gathered parameters: a block's placeholders are resolved (its bucket gathered) *before* the compiled
  block is entered, FSDP2's pre-forward position, so no parameter placeholder reaches the graph; the
  re-gather bookkeeping autograd calls (saved-tensor hooks) is ``torch.compiler.disable``d;
- shardings' per-op layer, while dynamo traces: the plan lookups run uncached at trace time, and the local einsum,
  ``blockwise`` and ``constrain`` take DTensor's own ``to_local``/``from_local``/``redistribute`` (the same blocks,
  layouts and backward) instead of their autograd functions that build DTensors by hand;
- DTensor's ``compute_global_tensor_info`` (C in torch 2.13, called by ``to_local``'s backward): a Python
  polyfill for dynamo (``shardings.runtime.compat.global_tensor_info``, installed where the private names live).
- inductor's decompositions, which run on the local blocks while DTensor records the op's own global layout:
  ``backend="inductor"`` compiles with :data:`shardings.ops.compile_decompositions.INDUCTOR`, whose ``aten.cat``
  lays out its result as the op does (a one-tensor ``torch.cat`` failed to compile gpt2's attention under zero3+tp).

Under ``pp`` each stage's blocks run the compiled block (the pipeline executor calls ``Stages.block``), under every
schedule; embedding, head, the carries' sends and receives and their arrival layout stay eager. Zero-bubble
schedules split a compiled block's backward without running it twice (:mod:`shardings.pipeline.backward`).

Each real rank compiles into an inductor cache of its own (:func:`rank_compile_cache`): torch 2.13's cache key
omits the rank that DTensor's traced graphs bake in (a Shard's offset), so on a warm shared cache one rank ran
another rank's compiled code: gated_conv under cp computed a loss 0.7% off and wrong gradients, silently, on the
second run of the same job only (pytorch/pytorch#188332 is the same collision on the all-gather bucketing path).
The step's ``inductor`` backend hits those caches (FX graph, AOTAutograd) although it brings decompositions of its
own (``shardings.runtime.compat.inductor_with``).

Guards: from the first step on, every batch leaf must keep its shape (a change would compile new graphs on
some ranks: it raises a :class:`~shardings.spec.errors.ShardingError` naming the leaf); from step
:data:`WARMUP_STEPS` on, the step runs under ``torch.compiler.set_stance("fail_on_recompile")`` with
``fail_on_recompile_limit_hit``, so any other recompile is an error, never a silent slow step.

Not compiled yet (a :class:`CompileFallbackWarning`, once per step object, and the eager step): layouts on the
DTensor path with a preset outside :data:`DTENSOR_PRESETS` (offload; hand-made layouts: no presets). Simulated
ranks cannot be compiled at all (``LocalTensorMode`` does not compose with AOTAutograd in torch 2.13): a
``ShardingError``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from core import tree
from shardings.ops.compile_decompositions import INDUCTOR
from shardings.pipeline import Stages
from shardings.runtime.compat import compiled_graphs, disable_current_modes, dynamo_config_patch, inductor_cache_dir
from shardings.runtime.simulate import simulated
from shardings.spec.errors import ShardingError, sharding_error
from shardings.spec.layouts import Layout
from shardings.spec.mesh import Mesh
from shardings.spec.placeholder import resolve

__all__ = ["DEFAULT_JIT_BACKEND", "DTENSOR_PRESETS", "WARMUP_STEPS", "CompileFallbackWarning", "Compiled",
           "rank_compile_cache"]

WARMUP_STEPS = 2  # steps that may compile; from then on a recompile is an error
DEFAULT_JIT_BACKEND = "inductor"  # train_step(jit=True)'s torch.compile backend when none is named
# TeraPipe compiles a prefix block's graph per chunk position (the prefix's length): the most it may hold, above
# torch's recompile limit (8) for that function alone (k chunks per sequence need k graphs; the plan's dynamic program
# cuts at most GRID = 256 positions, but every graph costs a compile: 64 is far beyond what pays)
PREFIX_GRAPHS = 64
# The presets whose compositions compile on the DTensor path (the local path's layouts always do); with pp, each
# stage runs on the DTensor path of the others.
DTENSOR_PRESETS = frozenset({"dp", "zero1", "zero2", "zero3", "hsdp", "tp", "sp", "cp", "ep", "pp"})


class CompileFallbackWarning(UserWarning):
    """``train_step(jit=True)`` runs this layout's step eagerly: its path cannot be compiled yet."""


def _resolved(tree_: Any) -> Any:
    """``tree_`` with every placeholder leaf gathered (a ZeRO-3 bucket), so the graph sees plain tensors."""
    return tree.map(resolve, tree_)


def compile_loss(loss_fn: Callable, backend: str) -> Callable:
    """The loss with its blocks compiled (each its own graph, collectives eager around it), or compiled whole
    when it declares no blocks.

    >>> loss = compile_loss(models.gpt.stages(cfg), "inductor")  # doctest: +SKIP
    """
    # inductor with the decompositions a DTensor's local blocks need (shardings.ops.compile_decompositions)
    options = dict(backend=INDUCTOR if backend == "inductor" else backend, dynamic=False, fullgraph=True)
    if isinstance(loss_fn, Stages):
        block = _outside_modes(torch.compile(loss_fn.block, **options))
        compiled = dataclasses.replace(loss_fn, block=lambda p, x, i: block(_resolved(p), x, i))
        if loss_fn.prefix_block is not None:  # TeraPipe's chunks: a graph per chunk position (its prefix's length)
            prefix = _outside_modes(torch.compile(loss_fn.prefix_block, **options))

            def prefix_block(p: Any, x: Any, i: int, past: list[Any]) -> Any:
                # torch's recompile limit (8 graphs per function) raised for this function's graphs only
                with dynamo_config_patch(recompile_limit=PREFIX_GRAPHS):
                    return prefix(_resolved(p), x, i, past)

            compiled = dataclasses.replace(compiled, prefix_block=prefix_block)
        return compiled
    whole = _outside_modes(torch.compile(loss_fn, **options))
    return lambda params, batch: whole(_resolved(params), batch)


def _outside_modes(graph: Callable) -> Callable:
    """``graph`` called with the step's dispatch modes paused: dynamo does not trace under one ("non-infra torch
    dispatch mode present"). A mode that ignores compile internals stays (``shardings.comms()``, which
    ``train_step`` counts by default): torch.compile compiles without it and runs the graphs under it, so the
    collectives inside a graph are counted once per call, as the eager step's are."""

    def call(*args: Any) -> Any:
        with disable_current_modes() as paused, contextlib.ExitStack() as kept:
            for mode in reversed(paused):  # bottom of the stack first, as they were entered
                if mode.ignore_compile_internals():
                    kept.enter_context(mode)
            return graph(*args)

    return call


_CACHE_ROOT: list[str] = []  # the inductor cache directory this process started with, once read
RANK_CACHES = "shardlab-ranks"  # under it: one directory per mesh and rank


def rank_compile_cache(mesh: Mesh) -> str | None:
    """Point this process's inductor caches at a directory of its own rank on ``mesh``, and return it (``None``
    without real ranks: one device has nothing to collide with, and simulated ranks do not compile).

    The directory is ``<inductor's cache dir>/shardlab-ranks/<mesh>/rank<r>``: the same rank of the same mesh
    reuses what it compiled before (a resumed run starts warm), and no rank ever loads another rank's code."""
    if not dist.is_initialized() or simulated():
        return None
    if not _CACHE_ROOT:
        _CACHE_ROOT.append(inductor_cache_dir())
    where = os.path.join(_CACHE_ROOT[0], RANK_CACHES, re.sub(r"\W+", "_", repr(mesh)).strip("_"),
                         f"rank{dist.get_rank()}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = where
    return where


class Compiled:
    """One train step's compiled loss and its guards (module docstring).

    Args:
        loss_fn: the step's loss (a ``Stages`` gets per-block graphs).
        backend: ``torch.compile``'s backend: ``"inductor"`` (fused kernels: what runs fast) or
            ``"aot_eager"`` (the same graphs through AOTAutograd without code generation: tests, where inductor's
            compile time would dominate).
        mesh: the step's mesh (named in errors).
    """

    def __init__(self, loss_fn: Callable, backend: str, mesh: Mesh):
        self.loss_fn, self.backend, self.mesh = compile_loss(loss_fn, backend), backend, mesh
        self.cache = rank_compile_cache(mesh)
        self.steps = 0
        self.shapes: list[tuple[Any, tuple[int, ...]]] | None = None  # batch leaf path -> its shape at step 0
        self.warned = False
        self.graphs = 0  # graphs compiled by this step's calls (each with its backward): the run's "compiled" line

    def fallback(self, why: str) -> None:
        """Warn (once) that this layout's step runs eagerly, and why."""
        if not self.warned:
            self.warned = True
            warnings.warn(CompileFallbackWarning(
                f"train_step(jit=True): {why}; this step runs eagerly (same results, no compiled graphs). "
                "Fix: pass jit=False to silence this, or, to compile, a layout made of the presets "
                f"{', '.join(sorted(DTENSOR_PRESETS))}"),
                stacklevel=4)

    def compiles(self, layout: Layout, local: bool) -> bool:
        """Whether ``layout``'s step runs the compiled loss (else it warns, once, and runs eagerly); raises under
        simulated ranks. ``local``: the step runs on the local path (plain tensors), which always compiles."""
        self.check_ranks()
        if local or (layout.presets and set(layout.presets) <= DTENSOR_PRESETS):
            return True
        self.fallback(f"layout {layout.name!r} runs on DTensors with presets outside {sorted(DTENSOR_PRESETS)} "
                      "(hand-made layouts, offload), whose per-op layer does not compile yet (docs/performance.md)")
        return False

    def check_ranks(self) -> None:
        """Raise under simulated ranks: their tensors (``LocalTensorMode``) cannot be compiled."""
        if simulated():
            raise sharding_error(
                "train_step(jit=True): compile needs real ranks; simulated ranks (shardings.simulate) run every rank "
                "in one process as LocalTensors, which torch.compile cannot trace (torch 2.13)",
                fix="run the step on real ranks with shardings.launch(fn, n), or pass jit=False under simulate",
                mesh=self.mesh)

    def check_batch(self, batch: Any) -> None:
        """Every batch leaf keeps the shape it had on the first step (the graphs are compiled for it)."""
        shapes = [(path, tuple(x.shape)) for path, x in tree.leaves_with_path(batch) if hasattr(x, "shape")]
        if self.shapes is None:
            self.shapes = shapes
            return
        for (path, want), (_, got) in zip(self.shapes, shapes, strict=True):
            if want != got:
                raise sharding_error(
                    f"train_step(jit=True) compiled its graphs for batch leaf shape {want}, got {got} at step "
                    f"{self.steps}; a new shape would compile new graphs (and, on real ranks, at different steps "
                    "on different ranks)", path=path, mesh=self.mesh,
                    fix="keep the batch shape fixed (pad to the sequence length, drop the last short batch), or "
                        "build another train_step for the new shape, or pass jit=False")

    @contextlib.contextmanager
    def running(self, batch: Any) -> Iterator[None]:
        """One compiled step: its batch checked; from :data:`WARMUP_STEPS` on, any recompile is an error."""
        self.check_ranks()
        self.check_batch(batch)
        warm = self.steps >= WARMUP_STEPS
        self.steps += 1
        if not warm:  # a warm step compiles nothing (below): only these count graphs (#41, the run's compile line)
            before = compiled_graphs()
            try:
                yield
            finally:
                self.graphs += compiled_graphs() - before
            return
        try:
            with torch.compiler.set_stance("fail_on_recompile"), \
                    dynamo_config_patch(fail_on_recompile_limit_hit=True):
                yield
        except RuntimeError as e:
            if "recompile" not in str(e).lower():
                raise
            raise ShardingError(str(sharding_error(
                f"train_step(jit=True) recompiled at step {self.steps - 1}, after its {WARMUP_STEPS} warm-up steps "
                f"({str(e).strip()})", mesh=self.mesh,
                fix="keep every input of the loss (batch shapes, dtypes, Python values it reads) the same from step "
                    "to step, or pass jit=False"))) from e
