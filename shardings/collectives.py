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

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed._local_tensor import maybe_run_for_local_tensor

from core import tree
from shardings.errors import sharding_error
from shardings.lower import rank_coords
from shardings.mesh import Mesh, register_group

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

AxisName = str | tuple[str, ...]

# Per thread, the meshes of the shard_map calls running right now, innermost last.
_STATE = threading.local()


def _meshes() -> list[Mesh]:
    if not hasattr(_STATE, "meshes"):
        _STATE.meshes = []
    return _STATE.meshes


@contextlib.contextmanager
def bind_mesh(mesh: Mesh) -> Iterator[None]:
    """Make ``mesh``'s axis names callable by collectives in the body (``shard_map`` uses this)."""
    _meshes().append(mesh)
    try:
        yield
    finally:
        _meshes().pop()


class _Axis(NamedTuple):
    """One (possibly flattened) mesh axis, resolved against the running process group."""

    names: tuple[str, ...]  # major to minor, as the user gave them
    size: int
    mesh: Mesh
    group: str  # process-group name over these ranks; its ranks are in mesh order
    order: tuple[int, ...] | None  # group rank of axis index k; None when they coincide

    def index_of(self, rank: int) -> int:
        """This axis's index (0..size-1) of global ``rank``."""
        coords = rank_coords(self.mesh)[rank]
        return _ravel([coords[n] for n in self.names], [self.mesh.shape[n] for n in self.names])

    def group_rank(self, index: int) -> int:
        return index if self.order is None else self.order[index]


def _ravel(coords: Sequence[int], sizes: Sequence[int]) -> int:
    flat = 0
    for c, s in zip(coords, sizes):
        flat = flat * s + c
    return flat


def _resolve(axis_name: AxisName, op: str) -> _Axis:
    if not _meshes():
        if torch._C._current_graph_task_id() != -1:  # recomputed in backward by activation checkpointing
            raise sharding_error(
                f"{op}({axis_name!r}) was recomputed during backward, outside shard_map: core.remat inside "
                "shard_map's f replays f's pieces where axis names are unbound",
                fix="apply core.remat to the whole shard_map-ed function instead: remat(shard_map(f, ...))",
                cls=RuntimeError,
            )
        raise sharding_error(
            f"{op}({axis_name!r}) called outside shard_map; collectives need the mesh that names the axis",
            fix=f"call {op} inside f of shardings.shard_map(f, mesh, in_specs, out_specs)",
            cls=RuntimeError,
        )
    mesh = _meshes()[-1]
    names = (axis_name,) if isinstance(axis_name, str) else axis_name
    if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
        raise sharding_error(
            f"{op}: axis_name must be a mesh axis name or a tuple of names, got {axis_name!r}",
            fix="write e.g. 'tp' or ('dp', 'tp')",
            mesh=mesh,
            cls=TypeError,
        )
    unknown = [n for n in names if n not in mesh.axis_names]
    if unknown or len(set(names)) != len(names):
        problem = f"unknown mesh axis {unknown[0]!r}" if unknown else f"an axis appears twice in {names}"
        raise sharding_error(
            f"{op}({axis_name!r}): {problem}", fix=f"use distinct axes among {mesh.axis_names}", mesh=mesh
        )
    size = mesh.axis_size(names)
    in_mesh_order = tuple(sorted(names, key=mesh.axis_names.index))
    # Size-1 axes change no group (and DeviceMesh cannot always slice them): leave them out.
    spanned = tuple(n for n in in_mesh_order if mesh.shape[n] > 1)
    if not spanned:  # nothing to communicate: collectives short-circuit and never touch a group
        group = ""
    elif len(spanned) == 1:
        group = mesh.device_mesh.get_group(spanned[0]).group_name
    else:
        group = mesh.device_mesh[spanned]._flatten().get_group().group_name  # cached by DeviceMesh
        register_group(group, "+".join(spanned))
    order = None
    if names != in_mesh_order:
        sizes = [mesh.shape[n] for n in in_mesh_order]
        order = tuple(
            _ravel([dict(zip(names, coords))[n] for n in in_mesh_order], sizes)
            for coords in itertools.product(*(range(mesh.shape[n]) for n in names))
        )
    return _Axis(names, size, mesh, group, order)


def _on_each_rank(ax: _Axis, fn: Callable[[int], Any]) -> Any:
    """``fn(axis index)`` for this rank: one value per simulated rank under ``simulate``."""
    return maybe_run_for_local_tensor(lambda rank: fn(ax.index_of(rank)))(ax.mesh.device_mesh.get_rank())


def _wait(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _reorder(x: torch.Tensor, order: Sequence[int] | None) -> torch.Tensor:
    """Block ``k`` of the result is block ``order[k]`` of ``x`` (blocks: equal slices of dim 0)."""
    if order is None:
        return x
    blocks = x.unflatten(0, (len(order), -1))  # [n, d0/n, ...]
    return blocks[list(order)].flatten(0, 1)  # [d0, ...]


def _inverse(order: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if order is None else tuple(sorted(range(len(order)), key=order.__getitem__))


# Communication primitives on dim 0. Blocks of dim 0 are in axis-index order on both sides.


def _all_reduce(x: torch.Tensor, ax: _Axis) -> torch.Tensor:
    if ax.size == 1:
        return x
    return _wait(funcol.all_reduce(x.contiguous(), "sum", ax.group))


def _gather0(x: torch.Tensor, ax: _Axis) -> torch.Tensor:
    """[d0, ...] -> [size * d0, ...]."""
    if ax.size == 1:
        return x
    return _reorder(_wait(funcol.all_gather_single(x.contiguous(), 0, ax.group)), ax.order)


def _scatter0(x: torch.Tensor, ax: _Axis) -> torch.Tensor:
    """[size * d0, ...] -> [d0, ...], summed over the axis."""
    if ax.size == 1:
        return x
    x = _reorder(x, _inverse(ax.order)).contiguous()
    return _wait(funcol.reduce_scatter_single(x, "sum", 0, ax.group))


def _all_to_all0(x: torch.Tensor, ax: _Axis) -> torch.Tensor:
    """[size * d0, ...] -> [size * d0, ...]: block k goes to axis index k; block j came from j."""
    if ax.size == 1:
        return x
    x = _reorder(x, _inverse(ax.order)).contiguous()
    return _reorder(_wait(funcol.all_to_all_single(x, None, None, ax.group)), ax.order)


def _permute(x: torch.Tensor, ax: _Axis, perm: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """``ppermute``'s communication: one ``all_to_all_single`` with per-rank split sizes."""
    dst_of = dict(perm)
    receivers = set(dst_of.values())
    # Complete the partial permutation (idle ranks send to themselves first), so every rank sends
    # and receives exactly one block; ranks that the user's perm leaves out are zeroed after.
    idle_src = [k for k in range(ax.size) if k not in dst_of]
    idle_dst = [k for k in range(ax.size) if k not in receivers]
    selfs = set(idle_src) & set(idle_dst)
    dst_of.update({k: k for k in selfs})
    dst_of.update(zip([k for k in idle_src if k not in selfs], [k for k in idle_dst if k not in selfs]))
    src_of = {d: s for s, d in dst_of.items()}
    rows = x.unsqueeze(0).contiguous()  # [1, *x.shape]: one row to send, one to receive
    if ax.size > 1:
        one_hot = lambda g: [int(j == g) for j in range(ax.size)]
        send = _on_each_rank(ax, lambda k: one_hot(ax.group_rank(dst_of[k])))
        recv = _on_each_rank(ax, lambda k: one_hot(ax.group_rank(src_of[k])))
        rows = _wait(funcol.all_to_all_single(rows, recv, send, ax.group))
    if len(receivers) == ax.size:
        return rows[0]
    keep = _on_each_rank(ax, lambda k: torch.tensor(k in receivers))
    return torch.where(keep, rows[0], torch.zeros((), dtype=x.dtype, device=x.device))


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
