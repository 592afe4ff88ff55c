"""Axis-named, differentiable collectives for use inside :func:`shardings.shard_map`.

Inside ``f`` of ``shard_map(f, mesh, ...)`` every rank holds plain local blocks; these functions
communicate across the ranks of one mesh axis (``"tp"``) or of a tuple of axes (``("dp", "tp")``,
one flattened axis, major to minor in the given order), as ``jax.lax`` does. They lower to
``torch.distributed._functional_collectives``, so a dispatch-mode counter sees ``_c10d_functional``
ops, and run the same under :func:`shardings.simulate` and under real processes.

Gradient convention (JAX's ``shard_map`` with ``check_rep=False``): each collective's backward is
its exact linear transpose over the per-rank values: ``psum``'s is ``psum``, ``all_gather``'s is
``psum_scatter`` (and back), ``ppermute``'s is the inverse permutation, ``all_to_all``'s is the
reversed ``all_to_all``. ``shard_map`` completes the convention at its boundary (see there), so
gradients through it equal those of the same function on full tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from core import tree
from shardings.comm.axis_comm import (
    AxisName,
    _all_reduce,
    _all_to_all0,
    _Axis,
    _gather0,
    _on_each_rank,
    _permute,
    _resolve,
    _scatter0,
)
from shardings.comm.axis_comm import bind_mesh as bind_mesh  # re-exported: ring_attention and tests import it here
from shardings.spec.errors import sharding_error

__all__ = [
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "pmean",
    "ppermute",
    "psum",
    "psum_scatter",
]


# Autograd: each collective's backward applies its transpose (itself a Function: higher orders work).


class _PSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ax: _Axis) -> torch.Tensor:
        ctx.ax = ax
        return _all_reduce(x, ax)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _PSum.apply(g, ctx.ax), None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ax: _Axis, dim: int) -> torch.Tensor:
        ctx.ax, ctx.dim = ax, dim
        return _gather0(x.movedim(dim, 0), ax).movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _PSumScatter.apply(g, ctx.ax, ctx.dim), None, None


class _PSumScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ax: _Axis, dim: int) -> torch.Tensor:
        ctx.ax, ctx.dim = ax, dim
        return _scatter0(x.movedim(dim, 0), ax).movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _AllGather.apply(g, ctx.ax, ctx.dim), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ax: _Axis, split: int, concat: int) -> torch.Tensor:
        ctx.ax, ctx.split, ctx.concat = ax, split, concat
        blocks = x.unflatten(split, (ax.size, -1)).movedim(split, 0)  # [n, ..., x.shape[split] / n, ...]
        got = _all_to_all0(blocks, ax)  # got[j]: block sent by axis index j
        return got.movedim(0, concat).flatten(concat, concat + 1)  # [..., n * x.shape[concat], ...]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _AllToAll.apply(g, ctx.ax, ctx.concat, ctx.split), None, None, None


class _PPermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ax: _Axis, perm: tuple[tuple[int, int], ...]) -> torch.Tensor:
        ctx.ax, ctx.perm = ax, perm
        return _permute(x, ax, perm)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _PPermute.apply(g, ctx.ax, tuple((d, s) for s, d in ctx.perm)), None, None


def _dim(dim: int, ndim: int, op: str, what: str, ax: _Axis) -> int:
    if not -ndim <= dim < ndim:
        raise sharding_error(
            f"{op}: {what}={dim} is out of range for a tensor with {ndim} dims",
            fix=f"pass {what} in [{-ndim}, {ndim})",
            mesh=ax.mesh,
        )
    return dim % ndim


def _check_divisible(x: torch.Tensor, dim: int, ax: _Axis, op: str, tiled: bool) -> None:
    n, d = ax.size, x.shape[dim]
    if (d % n if tiled else d - n) != 0:
        need = f"a multiple of {n}" if tiled else f"exactly {n}"
        raise sharding_error(
            f"{op} over {ax.names} (size {n}): dim {dim} has size {d}, expected {need}",
            fix="pick a dim whose size fits the axis size" + ("" if tiled else ", or pass tiled=True"),
            shape=x.shape,
            mesh=ax.mesh,
        )


# Public collectives: each maps over the tensor leaves of a pytree, as jax.lax does.


def psum(x: Any, axis_name: AxisName) -> Any:
    """Sum ``x`` over the ranks of ``axis_name``; every rank gets the total.

    Its backward is ``psum`` of the cotangent (the exact transpose, see the module docstring).

    Args:
        x: a tensor or a pytree of tensors (the local blocks inside ``shard_map``).
        axis_name: a mesh axis name, or a tuple of names treated as one flattened axis.

    Returns:
        The sums, with ``x``'s structure and shapes.

    Raises:
        RuntimeError: called outside ``shard_map``.
        ShardingError: an axis name the mesh does not have.

    >>> shard_map(lambda b: psum(b.sum(0), "dp"), Mesh(dp=4), P("dp"), P())(x)  # == x.sum(0)
    """
    ax = _resolve(axis_name, "psum")
    return tree.map(lambda t: _PSum.apply(t, ax), x)


def pmean(x: Any, axis_name: AxisName) -> Any:
    """Mean of ``x`` over the ranks of ``axis_name`` (``psum(x) / axis_size``).

    >>> shard_map(lambda b: pmean(b.mean(0), "dp"), Mesh(dp=4), P("dp"), P())(x)  # == x.mean(0)
    """
    ax = _resolve(axis_name, "pmean")
    return tree.map(lambda t: _PSum.apply(t, ax) / ax.size, x)


def all_gather(x: Any, axis_name: AxisName, *, axis: int = 0, tiled: bool = False) -> Any:
    """Gather the blocks of ``axis_name``'s ranks, in axis-index order; every rank gets them all.

    Args:
        x: a tensor or pytree of tensors.
        axis_name: a mesh axis name or a tuple of names (one flattened axis, major to minor).
        axis: with ``tiled=False``, where the new axis of size ``axis_size`` goes in the result;
            with ``tiled=True``, the dim along which the blocks are concatenated.
        tiled: concatenate instead of stacking.

    Returns:
        ``x`` stacked (shape ``[..., n, ...]``) or concatenated (``[..., n * d, ...]``). The backward
        is ``psum_scatter`` of the cotangent.

    >>> shard_map(lambda b: all_gather(b, "tp", tiled=True), Mesh(tp=2), P("tp"), P())(x)  # == x
    """
    ax = _resolve(axis_name, "all_gather")

    def gather(t: torch.Tensor) -> torch.Tensor:
        dim = _dim(axis, t.ndim + (not tiled), "all_gather", "axis", ax)
        return _AllGather.apply(t if tiled else t.unsqueeze(dim), ax, dim)

    return tree.map(gather, x)


def psum_scatter(x: Any, axis_name: AxisName, *, scatter_dimension: int = 0, tiled: bool = False) -> Any:
    """Sum over ``axis_name`` and give axis index ``k`` the ``k``-th block of ``scatter_dimension``.

    Args:
        x: a tensor or pytree of tensors.
        axis_name: a mesh axis name or a tuple of names.
        scatter_dimension: the dim to split; its size must equal the axis size (``tiled=False``,
            the dim is removed) or be a multiple of it (``tiled=True``, the dim shrinks ``n``-fold).
        tiled: keep the scattered dim (of size ``d / n``) instead of removing it.

    Returns:
        This rank's block of the sum. The backward is ``all_gather`` of the cotangent.

    >>> shard_map(lambda b: psum_scatter(b, "tp", tiled=True), Mesh(tp=2), P(), P("tp"))(x)  # == 2 * x
    """
    ax = _resolve(axis_name, "psum_scatter")

    def scatter(t: torch.Tensor) -> torch.Tensor:
        dim = _dim(scatter_dimension, t.ndim, "psum_scatter", "scatter_dimension", ax)
        _check_divisible(t, dim, ax, "psum_scatter", tiled)
        out = _PSumScatter.apply(t, ax, dim)
        return out if tiled else out.squeeze(dim)

    return tree.map(scatter, x)


def all_to_all(x: Any, axis_name: AxisName, split_axis: int, concat_axis: int, *, tiled: bool = False) -> Any:
    """Send block ``k`` of ``split_axis`` to axis index ``k``; concatenate what arrives along ``concat_axis``.

    JAX semantics: with ``tiled=False`` the size of ``split_axis`` must equal the axis size, that
    dim is removed and a new one of the axis size is inserted at ``concat_axis`` (of the result).
    With ``tiled=True`` no dim is added or removed: ``split_axis`` shrinks and ``concat_axis``
    grows ``n``-fold. The backward is the reversed ``all_to_all``.

    Args:
        x: a tensor or pytree of tensors.
        axis_name: a mesh axis name or a tuple of names.
        split_axis: the dim split into ``n`` blocks.
        concat_axis: the dim along which received blocks are joined, in sender axis-index order.
        tiled: see above.

    >>> # x: [e, t] with experts e sharded: route so that tokens t are sharded instead.
    >>> shard_map(lambda b: all_to_all(b, "ep", 1, 0, tiled=True), Mesh(ep=2), P("ep"), P(None, "ep"))(x)
    """
    ax = _resolve(axis_name, "all_to_all")

    def exchange(t: torch.Tensor) -> torch.Tensor:
        split = _dim(split_axis, t.ndim, "all_to_all", "split_axis", ax)
        concat = _dim(concat_axis, t.ndim, "all_to_all", "concat_axis", ax)
        _check_divisible(t, split, ax, "all_to_all", tiled)
        if tiled or split == concat:
            return _AllToAll.apply(t, ax, split, concat)
        # As jax.lax.all_to_all: a new size-1 dim at concat_axis receives the blocks; split_axis is dropped.
        if split < concat:
            concat += 1
        else:
            split += 1
        return _AllToAll.apply(t.unsqueeze(concat), ax, split, concat).squeeze(split)

    return tree.map(exchange, x)


def ppermute(x: Any, axis_name: AxisName, perm: Sequence[tuple[int, int]]) -> Any:
    """Send each rank's ``x`` along ``axis_name`` by ``perm``, pairs ``(source, destination)`` of axis indices.

    Each index may be a source at most once and a destination at most once; ranks that receive
    nothing get zeros (as in JAX). The backward sends cotangents back by the inverse permutation.
    One ``all_to_all_single`` carries it, with per-rank split sizes; a partial ``perm`` is completed
    with dummy sends (to self where possible) whose results are zeroed.

    Args:
        x: a tensor or pytree of tensors.
        axis_name: a mesh axis name or a tuple of names.
        perm: ``(src, dst)`` pairs, e.g. a ring ``[(i, (i + 1) % n) for i in range(n)]``.

    Raises:
        ShardingError: an index out of range, or an index used twice as source or destination.

    >>> ring = [(i, (i + 1) % 4) for i in range(4)]
    >>> shard_map(lambda b: ppermute(b, "cp", ring), Mesh(cp=4), P("cp"), P("cp"))(x)  # == x.roll(len(x) // 4)
    """
    ax = _resolve(axis_name, "ppermute")
    pairs = tuple((int(s), int(d)) for s, d in perm)
    for role, idx in (("source", [s for s, _ in pairs]), ("destination", [d for _, d in pairs])):
        bad = [i for i in idx if not 0 <= i < ax.size] or [i for i in idx if idx.count(i) > 1]
        if bad:
            raise sharding_error(
                f"ppermute({axis_name!r}): perm {list(pairs)} has {role} index {bad[0]} "
                f"{'out of range' if not 0 <= bad[0] < ax.size else 'more than once'} (axis size {ax.size})",
                fix=f"use each index in [0, {ax.size}) at most once as a {role}",
                mesh=ax.mesh,
            )
    return tree.map(lambda t: _PPermute.apply(t, ax, pairs), x)


def axis_index(axis_name: AxisName) -> torch.Tensor:
    """This rank's index along ``axis_name`` (row-major over a tuple), as a 0-d int64 tensor.

    Under :func:`shardings.simulate` it holds one value per simulated rank.

    >>> shard_map(lambda b: b + axis_index("tp"), Mesh(tp=2), P("tp"), P("tp"))(torch.zeros(2))  # [0., 1.]
    """
    ax = _resolve(axis_name, "axis_index")
    return _on_each_rank(ax, lambda k: torch.tensor(k))


def axis_size(axis_name: AxisName) -> int:
    """The number of ranks along ``axis_name`` (the product of the sizes for a tuple).

    >>> shard_map(lambda b: b / axis_size(("dp", "tp")), Mesh(dp=2, tp=2), P(), P())(x)  # == x / 4
    """
    return _resolve(axis_name, "axis_size").size
