"""``shard_map``: run a function on each rank's local blocks, with axis-named collectives inside.

The per-rank program sees plain tensors (``LocalTensor``s under :func:`shardings.simulate`) and
talks to other ranks only through :mod:`shardings.comm.collectives`. Its gradient is the exact adjoint
of that per-rank program (JAX's ``check_rep=False`` convention) completed at the boundary:

- an input that ``in_specs`` does not split over a mesh axis is the same block on every rank of
  that axis, so its gradient is the *sum* of the ranks' contributions: the local gradients are
  handed back as DTensor ``Partial`` over those axes (reduced when redistributed, as DP grads are);
- an output that ``out_specs`` does not split over an axis is promised equal on every rank of it,
  so each rank receives ``1 / n`` of its cotangent (``n`` = ranks along those axes).

Together these make gradients through ``shard_map`` equal those of the same computation on full
tensors, whatever the specs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate

from core import tree
from shardings.comm.axis_comm import bind_mesh
from shardings.runtime.compat import LocalTensor, enabled_local_tensor_mode, rank_map
from shardings.spec.errors import sharding_error
from shardings.spec.lower import on_mesh, to_placements
from shardings.spec.mesh import Mesh, P
from shardings.spec.placeholder import resolve

__all__ = ["shard_map"]


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, P)


def _specs_per_leaf(specs: Any, values: Any, what: str, root: str, mesh: Mesh) -> list[P | None]:
    """Broadcast the prefix tree ``specs`` over ``values``: one spec per leaf of ``values``."""
    by_path: dict[tuple[Any, ...], P | None] = {}
    for spec_path, spec in tree.leaves_with_path(specs, is_leaf=_is_spec):
        if not _is_spec(spec):
            raise sharding_error(
                f"{what} has a {type(spec).__name__} leaf {spec!r} where a P(...) (or None) was expected",
                fix=f"make every leaf of {what} a shardings.P",
                path=f"{what}{tree.keystr(spec_path)}",
                mesh=mesh,
                cls=TypeError,
            )
        sub = values
        for depth, key in enumerate(spec_path):
            try:
                if tree.structure(sub).is_leaf():
                    raise LookupError
                sub = key.get(sub)
            except (LookupError, TypeError, AttributeError):
                raise sharding_error(
                    f"{what} has an entry at {what}{tree.keystr(spec_path)} but {root}"
                    f"{tree.keystr(spec_path[: depth + 1])} does not exist; {what} must be a tree prefix of {root}",
                    fix=f"give {what} the structure of {root} (or a prefix of it: one P for a whole subtree)",
                    spec=spec,
                    mesh=mesh,
                ) from None
        for sub_path, _ in tree.leaves_with_path(sub):
            by_path[tuple(spec_path) + tuple(sub_path)] = spec
    out = []
    for path, _ in tree.leaves_with_path(values):
        if tuple(path) not in by_path:
            raise sharding_error(
                f"{what} has no spec for {root}{tree.keystr(path)}; {what} must be a tree prefix of {root}",
                fix=f"add an entry for it to {what} (one P may cover a whole subtree)",
                mesh=mesh,
            )
        out.append(by_path[tuple(path)])
    return out


def _check_divisible(shape: Sequence[int], spec: P, mesh: Mesh, path: str) -> None:
    for dim, names in enumerate(spec.dim_axes()):
        n = mesh.axis_size(names)
        if shape[dim] % n:
            raise sharding_error(
                f"dim {dim} of size {shape[dim]} is split over {names} ({n} ranks); shard_map needs equal blocks",
                fix=f"make dim {dim} a multiple of {n}, or split it over fewer ranks",
                path=path,
                spec=spec,
                mesh=mesh,
                shape=shape,
            )


def _local_block(x: Any, spec: P | None, mesh: Mesh, path: str) -> Any:
    """The block of ``x`` this rank holds under ``spec``; its gradient comes back as a DTensor."""
    x = resolve(x)  # a ZeRO-3 placeholder: gathered now
    if not isinstance(x, torch.Tensor):
        return x
    dm = mesh.device_mesh
    placements = to_placements(spec, mesh, x.ndim, path=path)
    _check_divisible(x.shape, P() if spec is None else spec, mesh, path)
    if enabled_local_tensor_mode() is not None and not isinstance(x, (DTensor, LocalTensor)):
        # Made outside `simulate`: one tensor for all simulated ranks, so no per-rank gradient can reach it.
        if x.requires_grad:
            raise sharding_error(
                "a tensor created outside `simulate` needs gradients, but simulated ranks cannot send them back to it",
                fix="create it inside the `with shardings.simulate(n):` block",
                path=path,
                spec=spec,
                mesh=mesh,
                cls=TypeError,
            )
        x = rank_map(lambda _: x.clone())
    # A plain tensor is a full value, the same on every rank: slicing it costs no communication.
    x = on_mesh(x, mesh, what="the argument", fix="reshard it onto the mesh first, or pass the full tensor",
                path=path, spec=spec)
    if tuple(x.placements) != placements:
        x = x.redistribute(dm, placements)
    # Ranks along an axis the spec does not split hold the same block: their gradients add up.
    grads = [Partial() if isinstance(p, Replicate) else p for p in placements]
    return x.to_local(grad_placements=grads)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the cotangent by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g * ctx.scale, None


def _global_value(y: Any, spec: P | None, mesh: Mesh, path: str) -> Any:
    """Wrap this rank's output block into a DTensor laid out by ``spec``."""
    if not isinstance(y, torch.Tensor):
        return y
    if isinstance(y, DTensor):
        raise sharding_error(
            "f returned a DTensor; shard_map's f must return local blocks (plain tensors)",
            fix="return tensors computed from f's arguments, or call .to_local() on a captured DTensor",
            path=path,
            mesh=mesh,
            cls=TypeError,
        )
    placements: tuple[Placement, ...] = to_placements(spec, mesh, y.ndim, path=path)
    replicas = math.prod([size for name, size in mesh.shape.items() if name not in (spec or P()).axes])
    if replicas > 1 and y.requires_grad:
        y = _ScaleGrad.apply(y, 1.0 / replicas)
    return DTensor.from_local(y, mesh.device_mesh, placements, run_check=False)


def shard_map(f: Callable[..., Any], mesh: Mesh, in_specs: Any, out_specs: Any) -> Callable[..., Any]:
    """Map ``f`` over the blocks of its arguments, one call per rank, as ``jax.shard_map``.

    Each positional argument is laid out by ``in_specs`` (a tree prefix of the argument tuple:
    ``P`` leaves, ``None`` meaning replicated). A DTensor argument is redistributed to its spec if
    it differs; a plain tensor is taken as the full value, the same on every rank, and each rank
    slices its own block (no communication). Non-tensor leaves are passed to ``f`` unchanged.
    ``f`` gets this rank's blocks as plain tensors (``LocalTensor``s under ``simulate``) and may
    call :func:`psum`, :func:`all_gather`, ... by mesh axis name. Its outputs are this rank's
    blocks of DTensors laid out by ``out_specs`` (a tree prefix of the outputs): an axis an out
    spec leaves out means the output is replicated over it, which ``f`` promises (unchecked, as
    JAX's ``check_rep=False``). Differentiable end to end; see the module docstring for gradients.

    Args:
        f: the per-rank function, taking local blocks and returning a pytree of local blocks.
        mesh: the mesh whose axis names the specs and collectives use.
        in_specs: a pytree prefix of the positional arguments, ``P``/``None`` leaves.
        out_specs: a pytree prefix of ``f``'s output.

    Returns:
        A function of the same positional arguments returning DTensors (non-tensor outputs as is).

    Raises:
        ShardingError: specs that do not match the arguments/outputs, unknown axes, sharded dims
            not divisible by their ranks, a DTensor on another mesh.

    >>> mesh = Mesh(dp=2, tp=2)
    >>> matmul = shard_map(lambda x, w: psum(x @ w, "tp"), mesh, (P("dp", "tp"), P("tp")), P("dp"))
    >>> matmul(x, w).full_tensor()  # == x @ w
    """
    if not isinstance(mesh, Mesh):
        raise sharding_error(
            f"shard_map expected a shardings.Mesh, got {type(mesh).__name__}", fix="pass Mesh(...)", cls=TypeError
        )

    def mapped(*args: Any) -> Any:
        specs = _specs_per_leaf(in_specs, args, "in_specs", "args", mesh)
        flat, treedef = tree.flatten_with_path(args)
        local = [_local_block(x, s, mesh, f"args{tree.keystr(p)}") for (p, x), s in zip(flat, specs)]
        with bind_mesh(mesh):
            out = f(*tree.unflatten(treedef, local))
        specs = _specs_per_leaf(out_specs, out, "out_specs", "outputs", mesh)
        flat, treedef = tree.flatten_with_path(out)
        return tree.unflatten(
            treedef, [_global_value(y, s, mesh, f"outputs{tree.keystr(p)}") for (p, y), s in zip(flat, specs)]
        )

    # traced (a shard_map built inside a compiled block, as attention's): dynamo cannot copy f's __dict__
    return mapped if torch.compiler.is_compiling() else functools.wraps(f)(mapped)
