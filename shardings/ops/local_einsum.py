"""``einsum`` on each rank's local blocks when the operands' layouts already agree: no collectives.

JAX runs an einsum under ``shard_map``/``local_map`` on the per-device blocks; Megatron writes
column- and row-parallel linears by hand. Both are one rule on the operands' specs, applied per
mesh axis: when every operand that has an index splits it over the same axes (and no two indices
share an axis), each rank's blocks multiply to its block of the result.

- an index split over axes ``A`` keeps them in the output (column-parallel: ``e h d`` with ``h`` on tp
  gives ``b s h d`` with ``h`` on tp; data axes on ``b``/``s`` pass through the same way);
- a contracted index split over ``A`` leaves each rank a partial sum: the output is ``Partial`` over
  ``A`` (row-parallel: ``h`` on tp in both operands of ``b s h d, h d e``).

DTensor's own einsum reaches the same placements, but through a flatten of the batch dims and a
search over redistributions that costs minutes on a 3-D mesh when ``(batch, seq)`` flatten to a
``_StridedShard``. Anything the rule does not cover (a ``Partial`` operand, an index split
differently in two operands, two indices on one axis, an uneven split, ``...``) falls back to ``einops.einsum`` on
the DTensors: never wrong, only slower.

Gradients are the transpose of the same local program: in backward the output cotangent is
redistributed to the output's placements with ``Partial`` → replicated (the transpose of a sum is a
broadcast), each operand's gradient is an einsum of blocks, and an operand replicated over an axis
that another index splits gets its gradient as ``Partial`` there (each rank saw only its block of
that index).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import einops
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate

from shardings.comm.flat_comm import from_block
from shardings.residency.lazy_params import resolve
from shardings.runtime import fastlocal
from shardings.runtime.compat import LocalTensor, enabled_local_tensor_mode
from shardings.spec.lower import from_placements, mesh_of, to_placements
from shardings.spec.mesh import Mesh, P

__all__ = ["einsum"]


class _Plan(NamedTuple):
    """How a local einsum lays out its result and its operands' gradients."""

    out_placements: tuple[Placement, ...]
    out_shape: tuple[int, ...]
    grad_placements: tuple[tuple[Placement, ...], ...]  # one per operand


def einsum(*tensors_and_pattern: torch.Tensor | str) -> torch.Tensor:
    """``einops.einsum`` that multiplies local blocks when the operands' DTensor layouts agree.

    Plain tensors take ``einops.einsum``, or one matrix product for a two-operand contraction (the models'
    projections; equal to ``einops.einsum`` up to the matmul's summation order). DTensors on
    one mesh whose specs are consistent for ``pattern`` (see the module docstring) are multiplied
    block by block with no communication; any other DTensor input goes through ``einops.einsum``.

    Args:
        *tensors_and_pattern: the operands, then an einops pattern with named dims,
            e.g. ``"b s e, e h d -> b s h d"``.

    Returns:
        The result: a plain tensor, or a DTensor whose placements follow from the operands'.

    >>> with simulate(2):
    ...     mesh = Mesh(tp=2)
    ...     h = shard(torch.ones(2, 3, 4), P(), mesh)
    ...     w = shard(torch.ones(4, 2, 8), P(None, "tp"), mesh)  # column-parallel: heads on tp
    ...     spec_of(einsum(h, w, "b s e, e h d -> b s h d"))
    P(None, None, 'tp')
    """
    *operands, pattern = tensors_and_pattern
    operands = [resolve(x) for x in operands]  # a ZeRO-3 placeholder: gathered now
    if any(isinstance(x, DTensor) for x in operands):
        plan = _plan_for(pattern, operands)
        if plan is not None:
            if torch.compiler.is_compiling():
                return _traced_local_einsum(pattern, plan, operands)
            return _LocalEinsum.apply(pattern, plan, *operands)
        return einops.einsum(*operands, pattern)
    return _einsum_plain(pattern, *operands)


class _LocalEinsum(torch.autograd.Function):
    """The einsum of each rank's blocks; backward is the einsum transpose on blocks, laid out by the plan.

    The operands are saved as DTensors (not their local blocks) so that saved-tensor hooks see them:
    ZeRO-3 (:mod:`shardings.residency.gather_params`) recognizes a gathered parameter and re-gathers it in
    backward instead of keeping it alive.
    """

    @staticmethod
    def forward(ctx: Any, pattern: str, plan: _Plan, *operands: DTensor) -> DTensor:
        ctx.pattern, ctx.plan = pattern, plan
        ctx.save_for_backward(*operands)
        out = _einsum_per_rank(pattern, *(x.to_local() for x in operands))
        return wrap_block(out, operands[0].device_mesh, plan.out_placements, plan.out_shape)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor | None, ...]:
        operands, plan = ctx.saved_tensors, ctx.plan
        # the cotangent of a Partial output is replicated: each rank's partial sum feeds the whole
        out_layout = tuple(Replicate() if isinstance(p, Partial) else p for p in plan.out_placements)
        g = grad.redistribute(grad.device_mesh, out_layout).to_local()
        inputs, output = _parse(ctx.pattern, [x.ndim for x in operands])
        blocks = [x.to_local() for x in operands]
        grads: list[DTensor | None] = []
        for i, (x, letters) in enumerate(zip(operands, inputs, strict=True)):
            if not ctx.needs_input_grad[2 + i]:
                grads.append(None)
                continue
            others = [(b, names) for j, (b, names) in enumerate(zip(blocks, inputs)) if j != i]
            seen = set(output).union(*(names for _, names in others))
            kept = [letter for letter in letters if letter in seen]  # a letter only here was summed: broadcast back
            terms = ", ".join(" ".join(names) for names in (output, *(names for _, names in others)))
            local = _einsum_per_rank(f"{terms} -> {' '.join(kept)}", g, *(b for b, _ in others))
            if len(kept) < len(letters):
                sizes = {k: n for k, n in zip(letters, blocks[i].shape) if k not in seen}
                local = einops.repeat(local, f"{' '.join(kept)} -> {' '.join(letters)}", **sizes)
            grads.append(wrap_block(local, x.device_mesh, plan.grad_placements[i], tuple(x.shape)))
        return None, None, *grads


def _traced_local_einsum(pattern: str, plan: _Plan, operands: list[DTensor]) -> DTensor:
    """:class:`_LocalEinsum` as torch.compile traces it (``train_step(jit=True)``): the same blocks and layouts
    through DTensor's own ``to_local``/``from_local``, whose backward is the einsum transpose the plan lays out:
    the output cotangent goes to the output's placements with ``Partial`` -> replicated (``from_local``), each
    operand's gradient block comes back with the plan's placements (``to_local(grad_placements=...)``). Eagerly
    those two autograd nodes and their checks cost more than the small einsums they wrap: hence the function."""
    blocks = [x.to_local(grad_placements=g) for x, g in zip(operands, plan.grad_placements, strict=True)]
    out = _einsum_plain(pattern, *blocks)
    return DTensor.from_local(out, operands[0].device_mesh, plan.out_placements, run_check=False,
                              shape=plan.out_shape, stride=_global_stride(out, plan.out_shape))


def _einsum_per_rank(pattern: str, *blocks: torch.Tensor) -> torch.Tensor:
    """``einops.einsum(*blocks, pattern)``; under simulated ranks, on each rank's plain tensors: a ``LocalTensor``
    op costs ~1 ms of aliasing bookkeeping, and ``torch.einsum`` decomposes into several views and a ``bmm``."""
    mode = enabled_local_tensor_mode()
    if mode is None or not any(isinstance(b, LocalTensor) for b in blocks):
        return _einsum_plain(pattern, *blocks)
    return fastlocal.rank_map(mode,  # each rank's plain einsum with no Python mode in the way (where none else runs)
        lambda r: einops.einsum(*(b._local_tensors[r] if isinstance(b, LocalTensor) else b for b in blocks), pattern)
    )


def _einsum_plain(pattern: str, *tensors: torch.Tensor) -> torch.Tensor:
    """``einops.einsum`` on plain tensors; a two-operand contraction whose output is one operand's free dims then
    the other's (every projection of the models: ``b s e, e h d -> b s h d``) is one matrix product: ``mm`` on
    2-D views when the contracted dims trail the first operand and lead the second, in order (what ``nn.Linear``
    runs), else ``torch.tensordot``. ``torch.einsum`` goes through ``bmm`` with a batch of one and a dozen view
    and permute ops (and their backward nodes) around it: 1.07× the native model's CPU time at gpt_small."""
    # traced (train_step(jit=True)): the uncached function, which dynamo runs at trace time without a warning
    lookup = _tensordot_dims.__wrapped__ if torch.compiler.is_compiling() else _tensordot_dims
    dims = lookup(pattern, tuple(t.ndim for t in tensors))
    if dims is None:
        return einops.einsum(*tensors, pattern)
    swap, a_dims, b_dims = dims
    a, b = tensors[::-1] if swap else tensors
    k = len(a_dims)
    if a_dims == tuple(range(a.ndim - k, a.ndim)) and b_dims == tuple(range(k)):
        inner = math.prod(b.shape[:k])
        return (a.reshape(-1, inner) @ b.reshape(inner, -1)).view(*a.shape[:a.ndim - k], *b.shape[k:])
    return torch.tensordot(a, b, dims=(list(a_dims), list(b_dims)))


@functools.lru_cache(maxsize=1024)
def _tensordot_dims(pattern: str, ndims: tuple[int, ...]) -> tuple[bool, tuple[int, ...], tuple[int, ...]] | None:
    """``(swap, a_dims, b_dims)`` when ``pattern`` is a tensordot of its two operands (in that order, or swapped),
    else ``None``; a pure function of the pattern's text and the ranks."""
    names = _parse(pattern, list(ndims))
    if names is None or len(names[0]) != 2:
        return None
    (a, b), out = names
    shared = [x for x in a if x in b]
    if any(x in out for x in shared) or not set(a) ^ set(b) <= set(out):
        return None  # a batch index (in both operands and the output), or an index summed within one operand
    free_a, free_b = [x for x in a if x not in shared], [x for x in b if x not in shared]
    for swap, (first, second, free) in enumerate(((a, b, free_a + free_b), (b, a, free_b + free_a))):
        if out == free:
            return bool(swap), tuple(first.index(x) for x in shared), tuple(second.index(x) for x in shared)
    return None


def wrap_block(
    local: torch.Tensor, device_mesh: Any, placements: tuple[Placement, ...], shape: tuple[int, ...]
) -> DTensor:
    """A DTensor of global ``shape`` whose block on this rank is ``local`` (in its memory order), with no
    autograd node: for use inside an autograd function's forward or backward."""
    return from_block(local, device_mesh, placements, shape, _global_stride(local, shape))


def _global_stride(local: torch.Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Contiguous strides of ``shape`` in the memory order of ``local`` (einsum may return a permuted view)."""
    order = sorted(range(len(shape)), key=lambda d: -local.stride(d))  # outermost dim first; stable on ties
    stride, step = [0] * len(shape), 1
    for d in reversed(order):
        stride[d] = step
        step *= max(shape[d], 1)
    return tuple(stride)


def _plan_for(pattern: str, operands: list[torch.Tensor]) -> _Plan | None:
    """The plan for these operands, or ``None`` when they must take the ``einops.einsum`` fallback."""
    if not all(isinstance(x, DTensor) for x in operands):
        return None  # DTensor refuses plain tensors next to DTensors; einops gives that error
    device_mesh = operands[0].device_mesh
    if any(x.device_mesh != device_mesh for x in operands):
        return None
    mesh = mesh_of(operands[0])
    layouts = tuple((tuple(x.placements), tuple(x.shape)) for x in operands)
    # traced: the uncached function, which dynamo runs at trace time (the graph holds only its result)
    return (_plan.__wrapped__ if torch.compiler.is_compiling() else _plan)(pattern, mesh, layouts)


@functools.lru_cache(maxsize=4096)
def _plan(pattern: str, mesh: Mesh, layouts: tuple[tuple[tuple[Placement, ...], tuple[int, ...]], ...]) -> _Plan | None:
    """Derive output and gradient placements from the operands' ``(placements, shape)``; ``None`` = fall back."""
    names = _parse(pattern, [len(shape) for _, shape in layouts])
    if names is None:
        return None
    inputs, output = names
    specs = []
    for placements, _ in layouts:
        try:
            spec, partial = from_placements(placements, mesh)
        except ValueError:
            return None
        if partial:
            return None  # a pending sum would be multiplied into every term: let DTensor reduce it first
        specs.append(spec)
    axes_of: dict[str, tuple[str, ...]] = {}  # index -> the mesh axes that split it (major to minor)
    size_of: dict[str, int] = {}
    for letters, spec, (_, shape) in zip(inputs, specs, layouts, strict=True):
        dim_axes = spec.dim_axes() + ((),) * (len(shape) - len(spec))
        for letter, axes, size in zip(letters, dim_axes, shape, strict=True):
            if axes_of.setdefault(letter, axes) != axes or size_of.setdefault(letter, size) != size:
                return None  # split differently (or broadcast) in two operands: blocks would not line up
            if size % mesh.axis_size(axes):
                return None  # uneven blocks: rank-dependent shapes, left to DTensor (as before this module)
    used = [a for axes in axes_of.values() for a in axes]
    if len(used) != len(set(used)):
        return None  # two indices on one axis: the result's block would be a product of two splits
    out_shape = tuple(size_of[letter] for letter in output)
    out_spec = P(*(axes_of[letter] or None for letter in output))
    contracted = {a for letter, axes in axes_of.items() if letter not in output for a in axes}
    try:
        out_placements = _with_partial(to_placements(out_spec, mesh, out_shape), contracted, mesh)
    except ValueError:
        return None
    grads = tuple(
        _with_partial(placements, set(used) - {a for axes in spec.dim_axes() for a in axes}, mesh)
        for (placements, _), spec in zip(layouts, specs, strict=True)
    )
    return _Plan(out_placements, out_shape, grads)


def _parse(pattern: str, ndims: list[int]) -> tuple[list[list[str]], list[str]] | None:
    """``"b s e, e h d -> b s h d"`` → per-operand and output index names; ``None`` for what the plan does not cover."""
    if "->" not in pattern or "..." in pattern or "(" in pattern:
        return None
    lhs, rhs = pattern.split("->")
    inputs, output = [term.split() for term in lhs.split(",")], rhs.split()
    if [len(letters) for letters in inputs] != ndims:
        return None  # einops raises the error that names the mismatch
    if any(len(set(letters)) != len(letters) for letters in (*inputs, output)):
        return None  # a diagonal: its block is not a block of the diagonal
    if not set(output) <= {letter for letters in inputs for letter in letters}:
        return None
    return inputs, output


def _with_partial(placements: tuple[Placement, ...], axes: set[str], mesh: Mesh) -> tuple[Placement, ...]:
    """``placements`` with ``Partial`` (sum) on the device-mesh dims of ``axes``."""
    partial = {mesh.device_axes.index(a) for a in axes}
    return tuple(Partial() if m in partial else p for m, p in enumerate(placements))
