"""What the model itself costs per batch row, on one device: a fake forward and backward, no mesh.

The planner's estimates scale these numbers to a candidate (rows per rank, tensor/context split, remat) before
the exact fake steps (:mod:`shardings.planner.fake_step`) refine the best. Measured at ``period`` and
``2·period`` blocks (a block's cost is the difference: ``period`` is the smallest repeat of the blocks'
parameter shapes, 2 for an MoE model with ``moe_every=2``), one row each:

- FLOPs of matmuls and attention (and how many ops they are) and bytes moved by the other ops
  (:class:`~shardings.planner.fake_step.OpCounter`);
- ops dispatched;
- bytes of activations saved for backward, and the part of them shaped like the residual stream (last dim the
  model's width: what tensor parallelism leaves whole unless sequence parallelism splits it).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

import core
from core import deferred, tree
from shardings.planner.fake_step import OpCounter
from shardings.runtime.compat import FakeTensorMode

__all__ = ["Part", "Profile", "block_period", "profile", "row_tokens"]


@dataclasses.dataclass(frozen=True)
class Part:
    """Per batch row: FLOPs, other ops' bytes, ops, saved activation bytes (and their residual-shaped part)."""

    flops: float
    matmuls: float
    bytes: float
    moves: float
    ops: float
    saved: float
    saved_residual: float

    def __sub__(self, other: Part) -> Part:
        return Part(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def __mul__(self, k: float) -> Part:
        return Part(*(a * k for a in dataclasses.astuple(self)))


@dataclasses.dataclass(frozen=True)
class Profile:
    """The model's cost per row: ``block`` (one block, averaged over a period) and ``edge`` (outside the blocks)."""

    block: Part
    edge: Part
    period: int
    block_input: float  # bytes of one row's block input (what remat keeps per block)


def block_period(model: Any, cfg: Any, blocks: str = "blocks") -> int:
    """The smallest ``p`` such that block ``i`` and ``i + p`` have the same parameter shapes (1: all alike)."""
    layers = getattr(cfg, "layers", 1)
    probe = dataclasses.replace(cfg, layers=min(layers, 8)) if dataclasses.is_dataclass(cfg) else cfg
    with deferred.deferred():
        recipes = model.init(core.random.key(0), probe)
    shapes = [tuple(tuple(x.shape) for x in tree.leaves(b)) for b in recipes.get(blocks, [])]
    for p in range(1, len(shapes) + 1):
        if all(shapes[i] == shapes[i + p] for i in range(len(shapes) - p)):
            return p
    return 1


def row_tokens(model: Any, cfg: Any) -> int:
    """Tokens per batch row in the model's residual stream: its config's ``seq_len``, else measured on fake tensors
    (nothing allocated) as the residual its first stage makes of a one-row example batch (a ViT: its patches and
    class token), the carry's tensor whose last dim is the config's ``dim``.

    Raises:
        ValueError: a config without ``seq_len`` whose model declares no ``stages`` or whose config has no ``dim``.
    """
    if hasattr(cfg, "seq_len"):
        return cfg.seq_len
    name = f"{type(cfg).__module__}.{type(cfg).__qualname__}"
    dim = getattr(cfg, "dim", None)
    if dim is None or not hasattr(model, "stages"):
        raise ValueError(f"{name} has no seq_len, and the planner cannot measure its tokens per row: that needs the "
                         f"model's stages(cfg) (its first stage's output) and a dim field (its width). Fix: give the "
                         f"Config a seq_len (tokens per row of its residual stream), or declare stages(cfg) and dim.")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with deferred.deferred():
        recipes = model.init(core.random.key(0), cfg)
    with mode:
        params = tree.map(lambda r: torch.empty(r.shape, dtype=r.dtype), recipes)
        carry = model.stages(cfg).first(params, model.example_batch(cfg, 1))
    residual = [x for x in tree.leaves(carry) if isinstance(x, torch.Tensor) and x.ndim >= 2 and x.shape[-1] == dim]
    if not residual:
        shapes = [tuple(x.shape) for x in tree.leaves(carry) if isinstance(x, torch.Tensor)]
        raise ValueError(f"{name} has no seq_len, and its first stage's output {shapes} has no tensor of width "
                         f"dim={dim} (the residual stream, (rows, tokens, dim)). Fix: give the Config a seq_len.")
    return residual[0].numel() // dim


@functools.lru_cache(maxsize=64)
def profile(model: Any, cfg: Any, compute_dtype: torch.dtype | None = None) -> Profile:
    """The model's cost per row (module docstring), its parameters cast to ``compute_dtype`` (``None``: as made).

    ``cfg`` must be hashable (a frozen dataclass); its ``layers`` is replaced by the probe's.
    """
    period = block_period(model, cfg)
    one, two = (_run(model, dataclasses.replace(cfg, layers=k * period), compute_dtype) for k in (1, 2))
    block = (two[0] - one[0]) * (1 / period)
    edge = one[0] - block * period
    return Profile(block, edge, period, one[1])


def _run(model: Any, cfg: Any, compute_dtype: torch.dtype | None) -> tuple[Part, float]:
    """One row's forward and backward on fake tensors: the :class:`Part` of the whole model, and the bytes of one
    block input (the residual stream of one row)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with deferred.deferred():
        recipes = model.init(core.random.key(0), cfg)
    dim = getattr(cfg, "dim", None)
    with mode:
        def fake(r: Any) -> torch.Tensor:
            dtype = compute_dtype if compute_dtype and r.dtype.is_floating_point else r.dtype
            return torch.empty(r.shape, dtype=dtype).requires_grad_(r.dtype.is_floating_point)

        params = tree.map(fake, recipes)
        batch = model.example_batch(cfg, 1)
        saved: dict[int, tuple[int, bool]] = {}
        weights = {id(p.untyped_storage()) for p in tree.leaves(params)}  # storages keep their Python object

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            if id(st) not in weights and t.is_floating_point():  # a weight's view (a transpose) is not an activation
                saved[id(st)] = (st.nbytes(), bool(dim) and t.shape[-1:] == (dim,))
            return t

        counter = OpCounter()
        with counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model.loss(params, batch, cfg)
            leaves = [p for p in tree.leaves(params) if p.requires_grad]
            torch.autograd.grad(loss, leaves, allow_unused=True)
    total = sum(n for n, _ in saved.values())
    residual = sum(n for n, r in saved.values() if r)
    width = (compute_dtype or torch.float32).itemsize
    part = Part(float(sum(counter.flops.values())), float(sum(counter.matmuls.values())), float(counter.bytes),
                float(counter.moves), float(sum(counter.ops.values())), float(total), float(residual))
    return part, float(cfg.seq_len * (dim or 0) * width)
