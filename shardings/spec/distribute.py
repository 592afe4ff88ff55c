"""Trees of tensors onto a mesh and back: ``shard``, ``gather``, ``reshard``, ``spec_of``, ``partial_axes``, and one
tensor built block by block on the ranks that hold it (``from_callback``).

``specs`` arguments are *prefix trees* of the value tree: one ``P`` (or ``None``, replicated) may
stand for a whole subtree, e.g. ``{"embed": P("tp"), "blocks": None}``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from core import tree
from shardings.runtime.compat import rank_map
from shardings.spec.errors import sharding_error
from shardings.spec.lower import coords_of_rank, from_placements, local_block, mesh_of, to_placements
from shardings.spec.mesh import Mesh, P

__all__ = ["from_callback", "gather", "partial_axes", "reshard", "shard", "spec_of"]


def _is_spec(s: Any) -> bool:
    return s is None or isinstance(s, P)


def _broadcast(specs: Any, values: Any, mesh: Mesh | None) -> list[tuple[tree.KeyPath, Any, Any]]:
    """``(path, leaf, spec)`` for every leaf of ``values``, each spec taken from its prefix in ``specs``.

    Raises:
        ValueError: a leaf with no spec on its path, or a spec whose path is not in ``values``.
    """
    by_path = dict(tree.leaves_with_path(specs, is_leaf=_is_spec))
    # Paths of every node of `values`, empty containers included (a spec for one matches nothing, harmlessly).
    ends = [path for path, _ in tree.leaves_with_path(values, is_leaf=_is_empty_container)]
    nodes = {path[:k] for path in ends for k in range(len(path) + 1)}
    for path, spec in by_path.items():
        if not _is_spec(spec):
            hint = " (a plain tuple of axis names is a subtree, not a spec)" if isinstance(spec, str) else ""
            raise sharding_error(
                f"expected a P(...) spec or None, got {type(spec).__name__} {spec!r}{hint}",
                fix="wrap the entries in shardings.P(...)",
                path=path,
                mesh=mesh,
                cls=TypeError,
            )
        if path not in nodes:
            raise sharding_error(
                "the specs tree has an entry here but the values tree does not",
                fix="give the specs the same structure as the values (check the keys and list lengths)",
                path=path,
                spec=spec,
                mesh=mesh,
            )
    out = []
    for path, leaf in tree.leaves_with_path(values):
        prefix = next((path[:k] for k in range(len(path) + 1) if path[:k] in by_path), None)
        if prefix is None:
            raise sharding_error(
                "the specs tree has no entry for this leaf (nor for any subtree holding it)",
                fix="give the specs the same structure as the values, or one P (or None) for a whole subtree",
                path=path,
                mesh=mesh,
            )
        out.append((path, leaf, by_path[prefix]))
    return out


def _is_empty_container(v: Any) -> bool:
    return isinstance(v, dict | list | tuple) and not v


def _unflatten_like(values: Any, new_leaves: list[Any]) -> Any:
    return tree.unflatten(tree.structure(values), new_leaves)


def shard(values: Any, specs: Any, mesh: Mesh) -> Any:
    """Place every tensor of ``values`` on ``mesh`` as a DTensor laid out by its spec.

    Every rank is assumed to hold the same full value (as after a seeded init), so no data moves:
    each rank keeps its own block (``distribute_tensor(..., src_data_rank=None)``).

    Args:
        values: a pytree of plain tensors (non-tensor leaves such as ``None`` pass through).
        specs: a prefix tree of ``values`` with ``P`` (or ``None``, replicated) leaves.
        mesh: the mesh; its size must equal the world size.

    Returns:
        The same tree with DTensor leaves.

    Raises:
        TypeError, ValueError: a specs tree that does not match ``values``, an invalid spec for a leaf,
            a leaf that already is a DTensor, or a spec on a non-tensor leaf. Messages name the key path.

    >>> mesh = Mesh(dp=2, tp=2)
    >>> with simulate(4):
    ...     params = shard({"w": torch.ones(8, 4), "b": torch.zeros(4)}, {"w": P("dp", "tp"), "b": None}, mesh)
    ...     spec_of(params)
    {'w': P('dp', 'tp'), 'b': P()}
    """
    device_mesh = mesh.device_mesh
    out = []
    for path, leaf, spec in _broadcast(specs, values, mesh):
        if isinstance(leaf, DTensor):
            raise sharding_error(
                f"the leaf already is a DTensor with spec {_describe(leaf)}",
                fix="use shardings.reshard(tree, specs) to change the layout of DTensors",
                path=path,
                spec=spec,
                mesh=mesh,
                cls=TypeError,
            )
        if not isinstance(leaf, torch.Tensor):
            if spec is not None and spec.normalized() != P():
                raise sharding_error(
                    f"the leaf is a {type(leaf).__name__}, not a tensor, so it cannot be sharded",
                    fix="give non-tensor leaves the spec None",
                    path=path,
                    spec=spec,
                    mesh=mesh,
                    cls=TypeError,
                )
            out.append(leaf)
            continue
        placements = to_placements(spec, mesh, leaf.shape, path=path)
        if not leaf.is_leaf:
            raise sharding_error(
                "the tensor is an intermediate result of autograd; shard places values such as parameters",
                fix="shard parameters before computing with them, or use shardings.constrain on activations",
                path=path,
                spec=spec,
                mesh=mesh,
            )
        out.append(distribute_tensor(leaf, device_mesh, placements, src_data_rank=None))
    return _unflatten_like(values, out)


def from_callback(shape: Sequence[int], spec: P, mesh: Mesh, block: Callable[[tuple[slice, ...]], torch.Tensor]
                  ) -> DTensor:
    """A DTensor of ``shape`` laid out by ``spec`` whose every rank calls ``block(slices)`` for its own block only
    (JAX's ``make_array_from_callback``): no rank builds or holds another rank's part. ``slices`` index the global
    tensor; on simulated ranks each one gets its own call.

    >>> with simulate(2):
    ...     x = from_callback((4, 2), P("dp"), Mesh(dp=2), lambda s: torch.arange(8.0).reshape(4, 2)[s])
    ...     gather(x)
    tensor([[0., 1.],
            [2., 3.],
            [4., 5.],
            [6., 7.]])
    """
    shape = tuple(shape)
    local = rank_map(lambda rank: block(local_block(shape, spec, mesh, coords_of_rank(rank, mesh))))
    return DTensor.from_local(local, mesh.device_mesh, to_placements(spec, mesh, len(shape)), run_check=False,
                              shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())


def gather(values: Any) -> Any:
    """Full (unsharded, reduced) tensors back from every DTensor leaf; other leaves pass through.

    ``Partial`` DTensors (e.g. data-parallel grads) are reduced on the way.

    >>> with simulate(2):
    ...     x = torch.arange(6.0)
    ...     torch.equal(gather(shard(x, P("dp"), Mesh(dp=2))), x)
    True
    """
    return tree.map(lambda x: x.full_tensor() if isinstance(x, DTensor) else x, values)


def reshard(values: Any, specs: Any) -> Any:
    """Redistribute every DTensor leaf to its new spec on the same mesh (the collectives follow).

    From ``Partial`` (unreduced) leaves, a replicated spec all-reduces and a sharded one
    reduce-scatters. Non-DTensor leaves pass through when their spec is ``None`` or replicated.

    Args:
        values: a pytree of DTensors.
        specs: a prefix tree of ``values`` with ``P`` (or ``None``, replicated) leaves.

    Returns:
        The same tree with redistributed DTensor leaves.

    Raises:
        TypeError, ValueError: a specs tree that does not match, an invalid spec for a leaf, or a
            sharded spec on a leaf that is not a DTensor. Messages name the key path.

    >>> with simulate(4):
    ...     x = shard(torch.ones(8, 8), P("dp", "tp"), Mesh(dp=2, tp=2))
    ...     spec_of(reshard(x, P(None, ("dp", "tp"))))
    P(None, ('dp', 'tp'))
    """
    out = []
    for path, leaf, spec in _broadcast(specs, values, None):
        if not isinstance(leaf, DTensor):
            if spec is not None and spec.normalized() != P():
                raise sharding_error(
                    f"the leaf is a {type(leaf).__name__}, not a DTensor, so it has no mesh to reshard on",
                    fix="place it first with shardings.shard(tree, specs, mesh)",
                    path=path,
                    spec=spec,
                    cls=TypeError,
                )
            out.append(leaf)
            continue
        mesh = mesh_of(leaf)
        placements = to_placements(spec, mesh, leaf.shape, path=path)
        out.append(leaf.redistribute(leaf.device_mesh, placements))
    return _unflatten_like(values, out)


def _describe(x: DTensor) -> str:
    spec, partial = from_placements(x.placements, mesh_of(x))
    return repr(spec) + (f" + partial {partial}" if partial else "")


def _leaf_spec(path: tree.KeyPath, x: Any) -> P | None:
    if not isinstance(x, DTensor):
        return None
    mesh = mesh_of(x)
    spec, partial = from_placements(x.placements, mesh)
    if partial:
        raise sharding_error(
            f"the DTensor is unreduced (Partial) over {partial}: its values must still be combined across "
            "those axes, so no P describes it",
            fix="reduce it with shardings.reshard(x, spec) (all-reduce or reduce-scatter), "
            "or inspect the pending reductions with shardings.partial_axes(x)",
            path=path,
            spec=spec,
            mesh=mesh,
        )
    return spec


def spec_of(values: Any) -> Any:
    """The normalized ``P`` of a DTensor, or a tree of them (``None`` for non-DTensor leaves).

    The result can be passed back to :func:`shard` / :func:`reshard`. Inside a tuple, size-1 axes
    carry no layout, so their position relative to other axes is not recoverable (they come first
    where possible).

    Raises:
        ValueError: a ``Partial`` (unreduced) DTensor — see :func:`partial_axes`.

    >>> with simulate(4):
    ...     spec_of({"w": shard(torch.ones(4, 4), P(None, "tp"), Mesh(dp=2, tp=2)), "step": 3})
    {'w': P(None, 'tp'), 'step': None}
    """
    return tree.map_with_path(_leaf_spec, values)


def partial_axes(values: Any) -> Any:
    """The pending reductions of a DTensor (mesh axis → reduce op), or a tree of them.

    Data-parallel grads come out ``Partial``: ``{"dp": "sum"}`` means the per-rank values must
    still be summed over ``dp``. Fully reduced DTensors and non-DTensor leaves give ``{}``.

    >>> partial_axes(grads)  # doctest: +SKIP
    {'w': {'dp': 'sum'}}
    """
    return tree.map(lambda x: from_placements(x.placements, mesh_of(x))[1] if isinstance(x, DTensor) else {}, values)
