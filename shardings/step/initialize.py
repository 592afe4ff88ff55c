"""Sharded init: every rank computes only the blocks it owns, equal bit for bit to the full init."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from core import deferred, tree
from shardings.comm import flat_comm
from shardings.pipeline import Plan, Schedule, plan_for
from shardings.runtime.compat import maybe_disable_local_tensor_mode, rank_map
from shardings.runtime.simulate import unwrap
from shardings.spec import layouts, lower
from shardings.spec.errors import sharding_error
from shardings.spec.mesh import Mesh, P
from shardings.spec.rules import is_names, logical_to_spec
from shardings.step.ownership import absent, ownership

__all__ = ["init", "param_specs", "recorded_axes"]

# Dims whose per-shard size must be whole: the model reshapes around them (heads × head_dim).
_MUST_DIVIDE = ("heads", "kv_heads", "head_dim")


def param_specs(axes: Any, params_like: Any, layout: Any, mesh: Mesh, role: str = "params") -> Any:
    """The spec tree for ``params_like`` (tensors or anything with ``.shape``) under a layout role.

    Checks that the axes tree matches the params tree and that dims named heads/kv_heads/head_dim
    divide evenly by the mesh axes they are sharded over.
    """
    layout = layouts.get(layout)
    rules = layout.role(role)
    axes_leaves, axes_def = tree.flatten(axes, is_leaf=is_names)
    leaves, params_def = tree.flatten_with_path(params_like)
    if axes_def != params_def:
        a = {tree.keystr(p) for p, _ in tree.leaves_with_path(axes, is_leaf=is_names)}
        b = {tree.keystr(p) for p, _ in leaves}
        raise sharding_error(
            f"the axes tree does not match the params tree (only in axes: {sorted(a - b)[:3]}, "
            f"only in params: {sorted(b - a)[:3]})",
            fix="give axes(cfg) exactly the structure of init(key, cfg), one names tuple per parameter",
            mesh=mesh,
        )
    specs = []
    for (path, leaf), names in zip(leaves, axes_leaves):
        if not hasattr(leaf, "shape"):
            raise sharding_error(
                f"this parameter leaf is a {type(leaf).__name__}, not a tensor",
                fix="make every parameter a tensor (core.random draws or torch.zeros/ones/full)",
                path=path,
                mesh=mesh,
                cls=TypeError,
            )
        shape = tuple(leaf.shape)
        if len(names) != len(shape):
            raise sharding_error(
                f"the logical names {names} have {len(names)} entries but the parameter has {len(shape)} dims",
                fix="give one logical name (or None) per dim",
                path=path,
                shape=shape,
                mesh=mesh,
            )
        spec = logical_to_spec(names, rules, mesh, path=path)
        for name, size, entry in zip(names, shape, spec.dim_axes()):
            parts = mesh.axis_size(entry)
            if name in _MUST_DIVIDE and size % parts:
                raise sharding_error(
                    f"dim {name!r} has size {size}, not divisible by {parts} (mesh axes {entry})",
                    fix=f"choose a {name} count divisible by {parts}, or a layout that keeps {name} whole",
                    path=path,
                    spec=spec,
                    shape=shape,
                    mesh=mesh,
                )
        specs.append(spec)
    return tree.unflatten(params_def, specs)


def _place(recipe: Any, spec: P, mesh: Mesh, path: Any) -> DTensor:
    if isinstance(recipe, torch.Tensor):  # materialized by the init function itself (e.g. an nn.Module's weights)
        full = recipe.detach()
        block = lambda slices: full[slices].clone()  # each rank its own copy: never the caller's storage
    elif isinstance(recipe, deferred.Deferred):
        block = recipe.block
    else:
        raise sharding_error(
            f"the init function returned a {type(recipe).__name__} leaf",
            fix="return tensors (core.random draws or torch.zeros/ones/full) as parameter leaves",
            path=path,
            cls=TypeError,
        )
    shape = tuple(recipe.shape)
    drawn: dict[tuple, torch.Tensor] = {}  # simulated ranks holding the same block draw it once (64 ranks: 32x)

    def local_of(rank: int) -> torch.Tensor:
        slices = lower.local_block(shape, spec, mesh, lower.coords_of_rank(rank, mesh))
        key = tuple((s.start, s.stop) for s in slices)
        if key in drawn:
            return drawn[key].clone()  # each rank its own storage: an in-place update stays on its rank
        drawn[key] = block(slices)
        return drawn[key]

    local = rank_map(local_of)
    stride = torch.empty(shape, device="meta").stride()
    placements = lower.to_placements(spec, mesh, len(shape), path=path)
    # not DTensor.from_local: its autograd node runs a view per simulated rank (0.1 s a leaf at 64 ranks)
    return flat_comm.from_block(local, mesh.device_mesh, placements, shape, stride)


def init(
    init_fn: Callable[[Any, Any], Any], key: torch.Tensor, cfg: Any, *, axes: Any, layout: Any, mesh: Mesh,
    plan: Plan | None = None, stage_sizes: list[int] | None = None, schedule: str | Schedule | None = None,
    virtual_stages: int | None = None,
) -> Any:
    """Initialize parameters directly in their sharded storage layout.

    The init function runs once in deferred mode (see ``core.deferred``): each parameter comes
    back as a recipe, and each rank evaluates only its own block of it. No rank materializes a
    full parameter, and ``gather`` of the result equals ``init_fn(key, cfg)`` bitwise.

    Args:
        init_fn: ``init(key, cfg) -> params``, written for one device with ``core.random``.
        key: a ``core.random`` key.
        cfg: the model config.
        axes: a tree like the params, each leaf a tuple of logical names.
        layout: a ``Layout`` or preset string; its ``params`` role decides storage.
        mesh: the mesh.
        plan: with ``pp``: the run's :func:`shardings.pipeline.plan`, as given to ``train_step``. On real
            processes each rank then materializes only the blocks its stages run (``params["blocks"][i]``); the
            others are absent (meta-device DTensors of the right shape and layout, holding no memory).
            Simulated ranks materialize every block.
        stage_sizes, schedule, virtual_stages: with ``pp`` and no ``plan``: what makes one (the same as given to
            ``train_step``; the placement of a named schedule's stages does not depend on its microbatches).

    Returns:
        The params tree with DTensor leaves.

    >>> with simulate(4):
    ...     params = init(models.mlp.init, core.random.key(0), cfg, axes=models.mlp.axes(cfg),
    ...                   layout="zero3", mesh=Mesh(dp=4))
    """
    layout = layouts.resolve(layout, mesh)
    stage_mesh = mesh.without("pp") if layout.pipelined else mesh  # pipeline stages: params live on the stage mesh
    stage_mesh.device_mesh  # noqa: B018  (no process group: shardlab's error saying what to do, before torch's)
    if isinstance(schedule, tuple):
        raise sharding_error("init(schedule=(name, virtual_stages)) is gone", mesh=mesh, cls=TypeError,
                             fix="pass plan=shardings.pipeline.plan(...), or schedule=name, virtual_stages=v")
    # Recipes are built from a plain key: under simulate a key made there is a LocalTensor, and every
    # block drawn from it would then be computed once per simulated rank (each rank doing all ranks' work).
    with maybe_disable_local_tensor_mode(), deferred.deferred():
        recipes = init_fn(unwrap(key), cfg)
    specs = param_specs(axes, recipes, layout, stage_mesh)
    plan = plan_for(layout, mesh, recipes, plan, schedule=schedule, virtual_stages=virtual_stages,
                    stage_sizes=stage_sizes)
    held = set(ownership(plan, recipes, mesh).held(len(tree.leaves(recipes))))
    leaves, treedef = tree.flatten_with_path(recipes)
    params = tree.unflatten(treedef, [
        _place(r, s, stage_mesh, path) if i in held
        else absent(r.shape, r.dtype, stage_mesh, lower.to_placements(s, stage_mesh, len(r.shape)))
        for i, ((path, r), s) in enumerate(zip(leaves, tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))))
    ])
    # Remembered so train_step can plan every role without being handed the axes again.
    for p, names in zip(tree.leaves(params), tree.leaves(axes, is_leaf=is_names)):
        p._logical_names = tuple(names)
    return params


def recorded_axes(params: Any) -> Any:
    """The logical axes :func:`init` recorded on each parameter, as a tree like ``params``.

    Raises:
        TypeError: a parameter without a record (not made by ``shardings.init``).
    """
    # Per parameter, not per name: a None *inside* a names tuple is a replicated dim, not a missing record.
    recorded = [getattr(p, "_logical_names", None) for p in tree.leaves(params)]
    if any(names is None for names in recorded):
        raise sharding_error(
            "train_step cannot tell the logical axes of the params (they were not made by shardings.init)",
            fix="pass axes=model.axes(cfg) to train_step",
            cls=TypeError,
        )
    return tree.unflatten(tree.structure(params), recorded)
