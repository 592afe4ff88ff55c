"""Named mesh axes inside ``shard_map`` → process groups, and one raw collective over them.

:func:`bind_mesh` makes a mesh's axis names visible to the body of ``shard_map``; :func:`_resolve`
turns an axis name (or a tuple of names, one flattened axis, major to minor) into an :class:`_Axis`:
its size, its process group and the group rank of each axis index. The ``_all_reduce`` /
``_gather0`` / ``_scatter0`` / ``_all_to_all0`` / ``_permute`` primitives then do one
``torch.distributed._functional_collectives`` call over that group on dim 0, with blocks in
axis-index order on both sides. They are not differentiable: the autograd Functions (each
collective's transpose) and the public ``psum`` & co. are in :mod:`shardings.comm.collectives`.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from shardings.runtime.compat import (
    all_gather_single,
    current_graph_task_id,
    funcol,
    maybe_run_for_local_tensor,
    reduce_scatter_single,
)
from shardings.spec.errors import sharding_error
from shardings.spec.lower import rank_coords
from shardings.spec.mesh import Mesh, register_group

AxisName = str | tuple[str, ...]

class _State(threading.local):
    """Per thread, the meshes of the shard_map calls running right now, innermost last. Made when a thread first
    reads it, so a compiled block that binds a mesh sees the same attributes on every call (no recompile)."""

    def __init__(self) -> None:
        self.meshes: list[Mesh] = []


_STATE = _State()


def _meshes() -> list[Mesh]:
    return _STATE.meshes


@contextlib.contextmanager
def bind_mesh(mesh: Mesh) -> Iterator[None]:
    """Make ``mesh``'s axis names callable by collectives in the body (``shard_map`` uses this).

    Traced, binding the innermost mesh again is a no-op: an autograd function's backward that names its axes
    (ring attention's) is traced by dynamo right after its forward, inside the same ``shard_map``, where a push
    on the stack would be a side effect dynamo refuses."""
    if torch.compiler.is_compiling() and _meshes() and _meshes()[-1] == mesh:
        yield
        return
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
        if current_graph_task_id() != -1:  # recomputed in backward by activation checkpointing
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
    if torch.compiler.is_compiling():  # real ranks only (train_step refuses to compile simulated ones)
        return fn(ax.index_of(ax.mesh.device_mesh.get_rank()))
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
    return _reorder(_wait(all_gather_single(x.contiguous(), 0, ax.group)), ax.order)


def _scatter0(x: torch.Tensor, ax: _Axis) -> torch.Tensor:
    """[size * d0, ...] -> [d0, ...], summed over the axis."""
    if ax.size == 1:
        return x
    x = _reorder(x, _inverse(ax.order)).contiguous()
    return _wait(reduce_scatter_single(x, "sum", 0, ax.group))


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
