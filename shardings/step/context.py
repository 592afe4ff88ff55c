"""What the gradient paths and the update read: small named records the step makes once and hands down.

The step (:mod:`shardings.step.train_step`) resolves its settings once and passes each path only these records;
a path returns what it produced and never sees the step object (no module of ``shardings.step`` imports
``train_step``):

- :class:`ParamPlan`: per parameter, its specs and placements for each role, its ZeRO-3 gather unit, who holds it;
- :class:`GradContext`: what a gradient path (local, DTensor, pipeline) reads;
- :class:`UpdateContext`: what the shared update (:mod:`shardings.step.update`) reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from core import tree
from shardings.comm import flat_comm
from shardings.pipeline import Plan
from shardings.spec import lower
from shardings.spec.layouts import PARAM_ROLES, Layout
from shardings.spec.mesh import Mesh, P
from shardings.step import local_step, mixed, ownership
from shardings.step.initialize import param_specs

__all__ = ["GradContext", "ParamPlan", "UpdateContext", "param_plan"]


class ParamPlan(NamedTuple):
    """Per-parameter specs for each role, resolved once from the logical axes, and who holds which leaf."""

    specs: dict[str, Any]
    placements: dict[str, list]
    treedef: Any
    local: local_step.LocalPlan | None  # set when the layout runs its loss on local tensors
    units: list[tuple]  # per leaf, its ZeRO-3 gather unit (flat_comm.unit_of: one block)
    ownership: ownership.Ownership  # the leaves this process holds and updates
    master: bool = False  # the optimizer state holds the master weights (mixed.keeps_master: ZeRO-1/2 + policy)


class GradContext(NamedTuple):
    """What a gradient path reads: the step's settings, resolved once."""

    layout: Layout
    mesh: Mesh  # where the parameters live: the stage mesh (``mesh.without("pp")``) under pp
    full_mesh: Mesh  # the whole mesh (with ``pp``)
    loss_fn: Callable  # ``loss(params, batch)``, or the model's ``Stages`` under pp
    cast: mixed.Cast
    token_count: Callable[[Any], torch.Tensor]
    accum_steps: int  # microbatches per step: the pipeline plan's under pp
    bucket_mb: float | None
    pipeline: Plan | None  # the run's pipeline plan (pp), else None
    compiled: Callable | None = None  # the loss (or Stages) whose blocks run compiled graphs, where the step compiles

    @property
    def run_fn(self) -> Callable:
        """What runs the model's compute: the compiled loss where the step compiles, else ``loss_fn``."""
        return self.compiled if self.compiled is not None else self.loss_fn


class UpdateContext(NamedTuple):
    """What the shared update reads: the optimizer (``inner``: without the clip), the clip, the loss scaler and
    where the state lives."""

    mesh: Mesh
    optimizer: Any  # what the state is made for: chain(clip, inner) with a clip, else inner
    inner: Any  # the optimizer's GradientTransformation
    clip: Any  # core.optim.clip_by_global_norm(clip_norm), or None
    clip_norm: float | None
    cast: mixed.Cast
    donate: bool
    offload_opt: bool  # the optimizer state lives in host memory (offload_optimizer)
    scaler: Any  # the policy's dynamic loss scaler (fp16), or None


def param_plan(params: Any, axes: Any, ctx: GradContext, local: bool) -> ParamPlan:
    """Specs and placements of every parameter for each role (``local``: the layout may run its loss on local
    tensors, :func:`shardings.step.local_step.plan` decides), and who holds which (the pipeline plan's owners)."""
    layout, mesh = ctx.layout, ctx.mesh
    specs = {r: param_specs(axes, params, layout, mesh, role=r) for r in PARAM_ROLES}
    flat = {r: tree.leaves(specs[r], is_leaf=lambda s: isinstance(s, P)) for r in PARAM_ROLES}
    placements = {r: [lower.to_placements(s, mesh, len(p.shape)) for s, p in zip(flat[r], tree.leaves(params))]
                  for r in PARAM_ROLES}
    units = [flat_comm.unit_of(path) for path, _ in tree.leaves_with_path(params)]
    lp = local and local_step.plan(placements, tree.leaves(params), layout, mesh, ctx.bucket_mb, units)
    held = ownership.ownership(ctx.pipeline, params, ctx.full_mesh)
    master = mixed.keeps_master(ctx.cast, tree.leaves(params), placements, mesh)
    return ParamPlan(specs, placements, tree.structure(params), lp or None, units, held, master)
