"""The one place where a ``P`` becomes DTensor placements, and back.

Every other module speaks ``P`` and logical names; only this module knows about ``Shard``,
``_StridedShard``, ``Replicate`` and ``Partial``.

Geometry (what DTensor does, and what :func:`local_block` reproduces): a dim split over the axes
``(a, b)`` is cut major to minor, with ``torch.chunk`` semantics at each level — first into
``size(a)`` chunks, then each of those into ``size(b)`` chunks — so uneven dims give the last
ranks smaller (possibly empty) blocks. When the axes of a tuple are listed in the mesh's order,
plain ``Shard`` placements do exactly that. In any other order DTensor needs ``_StridedShard``
(its ``split_factor`` is the product of the sizes of the axes that come earlier in the tuple but
later in the mesh), which is exact only when the dim divides evenly over the tuple's axes: such
specs are accepted for divisible dims and rejected, with a clear error, otherwise.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from shardings.runtime.compat import StridedShard
from shardings.spec.errors import sharding_error
from shardings.spec.mesh import Mesh, P, mesh_of_device_mesh, validate_spec

# DTensor logs a warning on every rank for each reduction over several mesh axes (it runs one
# collective per axis and suggests flattening the mesh). The results are exact; the warning floods
# training logs. Flattening those reductions is performance work, tracked in the issues.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

__all__ = [
    "constrain_to",
    "coords_of_rank",
    "from_placements",
    "local_block",
    "mesh_of",
    "on_mesh",
    "rank_coords",
    "to_placements",
    "without_size1_axes",
]


def _split_factors(axes: tuple[str, ...], mesh: Mesh) -> dict[str, int]:
    """For one dim split over ``axes`` (major to minor): each axis's DTensor split factor."""
    index = {name: i for i, name in enumerate(mesh.device_axes)}
    shape = mesh.shape
    return {
        name: math.prod([shape[earlier] for earlier in axes[:k] if index[earlier] > index[name]])
        for k, name in enumerate(axes)
    }


def to_placements(
    spec: P | None, mesh: Mesh, shape: Sequence[int] | int | None = None, path: Any = None
) -> tuple[Placement, ...]:
    """One placement per device-mesh axis (:attr:`Mesh.device_axes`, mesh order) for ``spec``.

    Args:
        spec: the partition spec (``None`` means replicated).
        mesh: the mesh whose axes the spec names.
        shape: the global tensor shape (or only its number of dims); the spec may not have more
            entries than dims, and with a full shape a tuple of axes listed out of mesh order must
            divide its dim evenly (pass the shape to get that check).
        path: the key path of the leaf, for error messages.

    Returns:
        A ``Shard``/``_StridedShard``/``Replicate`` per mesh axis.

    Raises:
        TypeError, ValueError: an invalid spec (see :func:`shardings.spec.mesh.validate_spec`), or a tuple
            out of mesh order over a dim that does not divide evenly.

    >>> to_placements(P(None, "tp"), Mesh(dp=2, tp=2))
    (Replicate(), Shard(dim=1))
    >>> to_placements(P(("tp", "dp")), Mesh(dp=2, tp=2), (8,))
    (_StridedShard(dim=0, sf=2), Shard(dim=0))
    """
    spec = validate_spec(spec, mesh, shape, path=path)
    shape = None if isinstance(shape, int) else shape
    placements: list[Placement] = [Replicate()] * len(mesh.device_axes)
    for dim, axes in enumerate(spec.dim_axes()):
        axes = tuple(a for a in axes if mesh.shape[a] > 1)  # size-1 axes are not in the device mesh
        factors = _split_factors(axes, mesh)
        strided = any(f > 1 for f in factors.values())
        n_chunks = mesh.axis_size(axes)
        if strided and shape is not None and shape[dim] % n_chunks:
            raise sharding_error(
                f"dim {dim} (size {shape[dim]}) is split over {axes}, which is not the mesh's axis order "
                f"{mesh.axis_names}; DTensor lays that out exactly only when the dim is divisible by "
                f"{n_chunks} (the product of those axis sizes)",
                fix=f"list the axes in mesh order, or make dim {dim} a multiple of {n_chunks}",
                path=path,
                spec=spec,
                mesh=mesh,
                shape=shape,
            )
        for name, factor in factors.items():
            i = mesh.device_axes.index(name)
            placements[i] = Shard(dim) if factor == 1 else StridedShard(dim, split_factor=factor)
    return tuple(placements)


def _axis_order(dim: int, factors: dict[int, int], mesh: Mesh, placements: Any) -> tuple[str, ...]:
    """Invert :func:`_split_factors`: the major-to-minor axes of one dim from mesh dim → split factor.

    Mesh dims are placed from the last to the first; each goes at the earliest position whose
    preceding (later-in-mesh) axes multiply to its split factor. Size-1 axes carry no layout, so
    where they sit in a tuple cannot be recovered; this puts them as early as their factor allows.
    """
    sizes = [mesh.shape[n] for n in mesh.device_axes]
    order: list[int] = []
    for m in sorted(factors, reverse=True):
        slot = next((k for k in range(len(order) + 1) if math.prod([sizes[j] for j in order[:k]]) == factors[m]), None)
        if slot is None:
            raise sharding_error(
                f"the placements {tuple(placements)} split dim {dim} in an order no P can express",
                fix="reshard the tensor to a spec first, e.g. shardings.reshard(x, P(...))",
                mesh=mesh,
            )
        order.insert(slot, m)
    return tuple(mesh.device_axes[m] for m in order)


def without_size1_axes(spec: P, mesh: Mesh) -> P:
    """``spec`` without its size-1 axes (normalized): the part of a spec that placements can express.

    >>> without_size1_axes(P(("tp", "dp"), "sp"), Mesh(dp=2, tp=1, sp=1))
    P('dp')
    """
    return P(*(tuple(a for a in axes if mesh.shape[a] > 1) for axes in spec.dim_axes())).normalized()


def from_placements(placements: Sequence[Placement], mesh: Mesh) -> tuple[P, dict[str, str]]:
    """Invert :func:`to_placements`: the normalized ``P`` and the pending-reduction (``Partial``) axes.

    Args:
        placements: one DTensor placement per device-mesh axis (:attr:`Mesh.device_axes`).
        mesh: the mesh the placements refer to.

    Returns:
        ``(spec, partial)``: ``spec`` describes how the data is laid out (a ``Partial`` axis counts as
        unsharded), and ``partial`` maps each ``Partial`` mesh axis to its reduce op (``"sum"``, ...).

    Raises:
        ValueError: a placement kind or a ``_StridedShard`` order that no ``P`` can express.

    >>> from_placements((Shard(1), Partial()), Mesh(tp=2, dp=2))
    (P(None, 'tp'), {'dp': 'sum'})
    """
    factors: dict[int, dict[int, int]] = {}  # tensor dim -> mesh dim -> split factor
    partial: dict[str, str] = {}
    for m, (name, p) in enumerate(zip(mesh.device_axes, placements, strict=True)):
        if isinstance(p, StridedShard):
            factors.setdefault(p.dim, {})[m] = int(p.split_factor)
        elif isinstance(p, Shard):
            factors.setdefault(p.dim, {})[m] = 1
        elif isinstance(p, Partial):
            partial[name] = p.reduce_op
        elif not isinstance(p, Replicate):
            raise sharding_error(
                f"mesh axis {name!r} has placement {p!r}, which no P can express",
                fix="reshard the tensor to a spec first, e.g. shardings.reshard(x, P(...))",
                mesh=mesh,
            )
    entries: list[Any] = [None] * (max(factors, default=-1) + 1)
    for dim, by_mesh_dim in factors.items():
        axes = _axis_order(dim, by_mesh_dim, mesh, placements)
        entries[dim] = axes[0] if len(axes) == 1 else axes
    return P(*entries).normalized(), partial


def mesh_of(x: DTensor) -> Mesh:
    """The ``Mesh`` (names and sizes) of a DTensor's device mesh.

    Raises:
        ValueError: the device mesh has no axis names (it was not built by ``Mesh``).
    """
    dm = x.device_mesh
    known = mesh_of_device_mesh(dm)
    if known is not None:
        return known
    if dm.mesh_dim_names is None:
        raise sharding_error(
            f"the DTensor's device mesh {dm} has no axis names",
            fix="build meshes with shardings.Mesh(...) and place tensors with shardings.shard",
        )
    return Mesh(dict(zip(dm.mesh_dim_names, dm.shape, strict=True)))


def coords_of_rank(rank: int, mesh: Mesh) -> dict[str, int]:
    """A global rank's coordinates on ``mesh`` (row-major, as ``Mesh.device_mesh`` lays ranks out).

    A stage mesh (``Mesh.without("pp")``) is a slice of its parent: the rank's coordinates on the parent,
    less the sliced axis (``Mesh(dp=2, pp=2).without("pp")``: global rank 2 has ``dp=1``).

    >>> coords_of_rank(1, Mesh(dp=2, tp=2))
    {'dp': 0, 'tp': 1}
    """
    parent = getattr(mesh, "_parent", None)
    if parent is not None:
        on_parent = coords_of_rank(rank, parent)
        return {name: on_parent.get(name, 0) for name in mesh.axis_names}
    c: dict[str, int] = {}
    for name, size in reversed(mesh.shape.items()):
        rank, c[name] = divmod(rank, size)
    return {name: c[name] for name in mesh.axis_names}


def rank_coords(mesh: Mesh) -> list[dict[str, int]]:
    """Every rank's coordinates on ``mesh``, indexed by global rank (see :func:`coords_of_rank`)."""
    return [coords_of_rank(rank, mesh) for rank in range(getattr(mesh, "_parent", mesh).size)]


def _chunk(start: int, stop: int, n_chunks: int, index: int) -> tuple[int, int]:
    """Block ``index`` of ``torch.chunk(range(start, stop), n_chunks)``; empty past the last chunk."""
    step = -(-(stop - start) // n_chunks)  # ceil
    lo = min(start + index * step, stop)
    return lo, min(lo + step, stop)


def local_block(shape: Sequence[int], spec: P | None, mesh: Mesh, coords: dict[str, int]) -> tuple[slice, ...]:
    """The block of the global tensor that the rank at mesh ``coords`` holds, one slice per dim.

    Agrees exactly with the local shard DTensor gives that rank for ``to_placements(spec, mesh, shape)``,
    uneven dims included (``torch.chunk`` semantics, major axis first).

    Args:
        shape: the global tensor shape.
        spec: the partition spec (``None`` means replicated).
        mesh: the mesh.
        coords: the rank's index along every mesh axis (see :func:`rank_coords`).

    Returns:
        A tuple of ``slice(start, stop)``, one per dim; ``x[block]`` is the rank's shard.

    >>> local_block((5, 4), P("dp", "tp"), Mesh(dp=2, tp=2), {"dp": 1, "tp": 0})
    (slice(3, 5, None), slice(0, 2, None))
    """
    spec = validate_spec(spec, mesh, shape)
    axes_per_dim = spec.dim_axes() + ((),) * (len(shape) - len(spec))
    block = []
    for size, axes in zip(shape, axes_per_dim):
        lo, hi = 0, size
        for name in axes:
            lo, hi = _chunk(lo, hi, mesh.shape[name], coords[name])
        block.append(slice(lo, hi))
    return tuple(block)


class _Constrain(torch.autograd.Function):
    """Redistribute forward; in backward, lay the gradient out like the input (``Partial`` → replicated).

    This is the transpose JAX gives ``with_sharding_constraint``: the cotangent takes the layout
    of the primal. A ``Partial`` input's cotangent is replicated (the transpose of a sum is a
    broadcast). It is also what makes Megatron's patterns emerge: a replicated activation entering
    a column-parallel matmul gets its ``Partial`` gradient all-reduced right there, and a
    sequence-sharded one gets it reduce-scattered.
    """

    @staticmethod
    def forward(ctx: Any, x: DTensor, placements: tuple[Placement, ...]) -> DTensor:
        ctx.mesh = x.device_mesh
        ctx.grad_placements = tuple(Replicate() if isinstance(p, Partial) else p for p in x.placements)
        if tuple(x.placements) == placements:  # an alias: still a node, whose backward lays the gradient out
            return DTensor(x._local_tensor.detach(), x._spec, requires_grad=False)
        return x.redistribute(x.device_mesh, placements)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor, None]:
        if tuple(grad.placements) == ctx.grad_placements:
            return grad, None
        return grad.redistribute(ctx.mesh, ctx.grad_placements), None


def on_mesh(x: torch.Tensor, mesh: Mesh, *, what: str, fix: str, path: Any = None, spec: Any = None) -> DTensor:
    """``x`` as a DTensor on ``mesh``'s device mesh, with no communication.

    A plain tensor is taken as the full value, the same on every rank (replicated); a DTensor
    must already live on this device mesh.

    Raises:
        ShardingError: ``x`` is a DTensor on another device mesh (``what`` names it, ``fix`` ends the message).
    """
    device_mesh = mesh.device_mesh
    if not isinstance(x, DTensor):
        return DTensor.from_local(x, device_mesh, [Replicate()] * device_mesh.ndim, run_check=False)
    if x.device_mesh != device_mesh:
        raise sharding_error(
            f"{what} is a DTensor on {x.device_mesh}, not on {mesh!r}'s device mesh", fix=fix, path=path, spec=spec,
            mesh=mesh,
        )
    return x


def constrain_to(x: DTensor, placements: Sequence[Placement]) -> DTensor:
    """``x`` redistributed to ``placements``, with the gradient laid out like ``x`` in backward.

    Traced (``train_step(jit=True)``): ``DTensor.redistribute``, which dynamo traces and whose backward is the
    same (the cotangent to ``x``'s placements, ``Partial`` -> replicated), an autograd node even when the
    placements already agree."""
    if torch.compiler.is_compiling():
        return x.redistribute(x.device_mesh, tuple(placements))
    return _Constrain.apply(x, tuple(placements))
