"""The sharded train step: the layout's tables decide every collective.

One step, for a layout and a mesh: the batch placed by the ``batch`` rules (:mod:`~shardings.step.batching`);
gradients from one of three paths, chosen from data, not from names — **local**
(:mod:`~shardings.step.local_step`) when the layout splits only the batch (``local_step.plan`` finds no
model-parallel axis), **pipeline** (:mod:`~shardings.step.pipeline_path`) when it pipelines the blocks, **DTensor**
(:mod:`~shardings.step.dtensor_path`) otherwise —, reduced into the ``opt_state`` placements; then the shared update
(:mod:`~shardings.step.update`: clipping, the optimizer on the leaves this process holds, fp16's skipped steps,
ZeRO-1/2's fp32 master weights). The step resolves its settings once into small records
(:mod:`~shardings.step.context`) that it hands each path; a path returns what it produced.

The loss is the mean over the global batch's tokens: each microbatch's mean weighted by its share of the tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

import core
from core import tree
from shardings.comm import accounting, buckets
from shardings.pipeline import Plan, Schedule, Split, Stages, plan_for
from shardings.residency import offload
from shardings.runtime.simulate import unwrap
from shardings.spec import layouts
from shardings.spec.errors import sharding_error
from shardings.spec.mesh import Mesh
from shardings.step import (
    batching,
    compiled,
    dtensor_path,
    finite,
    held_memory,
    local_step,
    mixed,
    ownership,
    pipeline_path,
    update,
)
from shardings.step.batching import default_token_count
from shardings.step.context import GradContext, ParamPlan, UpdateContext, param_plan
from shardings.step.initialize import recorded_axes

__all__ = ["ParamPlan", "TrainStep", "default_token_count", "train_step"]

_GONE = ("schedule", "microbatches", "stage_sizes", "virtual_stages")  # they made a pipeline plan: now plan=


def _refuse(gone: dict[str, Any]) -> None:
    for name in gone:
        raise TypeError(f"train_step({name}=...) is gone: pass plan=shardings.pipeline.plan(layout, mesh, params, "
                        f"{name}=...) (without pp: accum_steps=)" if name in _GONE else
                        f"train_step() got an unexpected keyword argument {name!r}")


def _scalar(x: torch.Tensor) -> float:
    """A replicated scalar (DTensor or not, simulated or not) as a Python float; simulated ranks must agree."""
    return float(unwrap((x.full_tensor() if isinstance(x, DTensor) else x).detach()))


class TrainStep:
    """A pure train step, eager or with its model compute compiled (``jit``). Build with :func:`train_step`."""

    def __init__(self, loss_fn, optimizer, *, layout, mesh, axes=None, accum_steps=1, clip_norm=None,
                 precision=None, token_count=default_token_count, bucket_mb=buckets.DEFAULT_BUCKET_MB, local=True,
                 count_comms=True, donate=False, plan: Plan | None = None, scalar_metrics: bool = True,
                 jit: bool = False, jit_backend: str = compiled.DEFAULT_JIT_BACKEND, **gone):
        _refuse(gone)
        if not isinstance(accum_steps, int) or accum_steps < 1:
            raise ValueError(f"train_step: accum_steps must be an int >= 1, got {accum_steps!r}")
        self.layout = layout = layouts.resolve(layout, mesh)  # a Layout checked on this mesh passes straight through
        layouts.warn_idle_axes(layout, mesh)  # zero3 on Mesh(dp=2, tp=2): tp idle, said once
        _check_pipelined(layout, loss_fn, plan, mesh)
        # the pipeline's stages run on the mesh of the other axes; mesh is where parameters live
        self.full_mesh, self.mesh = mesh, mesh.without("pp") if layout.pipelined else mesh
        self.pipeline: Plan | None = plan_for(layout, mesh, None, plan) if plan is not None else None
        self.last: Any = None  # the last step's pipeline.Result (timeline, P2P, saved activation peaks)
        self.axes, self.scalar_metrics, self.count_comms = axes, scalar_metrics, count_comms
        self.local = local and not layout.pipelined  # the pipeline path runs DTensors in each stage
        if "opt_state" in layout.host and not getattr(optimizer, "elementwise", False):
            raise sharding_error(
                f"layout {layout.name!r} keeps the optimizer state in host memory, and the update runs there "
                f"on each rank's blocks, which needs an elementwise optimizer; this one is not",
                fix="use core.optim.adamw/adam/sgd (or drop offload_optimizer from the layout)", mesh=mesh)
        cast, clip = mixed.Cast.of(precision), core.optim.clip_by_global_norm(clip_norm) if clip_norm else None
        accum = self.pipeline.microbatches if self.pipeline is not None else accum_steps
        self.context = GradContext(layout, self.mesh, mesh, loss_fn, cast, token_count, accum, bucket_mb,
                                   self.pipeline)
        self.update_context = UpdateContext(
            self.mesh, core.optim.chain(clip, optimizer) if clip else optimizer, optimizer, clip, clip_norm, cast,
            donate, "opt_state" in layout.host, precision.scaler if precision is not None else None)
        self.compiled = compiled.Compiled(loss_fn, jit_backend, mesh) if jit else None
        self._plan: ParamPlan | None = None
        self._grad_nbytes: int | None = None

    def plan(self, params: Any) -> ParamPlan:
        """Specs and placements of every parameter for each role, and who holds which (cached after the first)."""
        if self._plan is None:
            axes = self.axes if self.axes is not None else recorded_axes(params)
            self._plan = param_plan(params, axes, self.context, self.local)
        return self._plan

    @property
    def accum_steps(self) -> int:
        """Microbatches per step: the pipeline plan's under ``pp``."""
        return self.context.accum_steps

    @property
    def schedule(self) -> Schedule:
        """The pipeline plan's schedule (``print(step.schedule)``: each rank's actions in time)."""
        return self._pipeline().schedule

    def split(self, params: Any) -> Split:
        """Which blocks each stage runs (``print(step.split(params))``), from the pipeline plan."""
        return self._pipeline().split

    def _pipeline(self) -> Plan:
        if self.pipeline is None:
            raise sharding_error(f"layout {self.layout.name!r} does not pipeline the blocks: it has no pipeline plan",
                                 fix="add pp to the layout and pass plan=shardings.pipeline.plan(...)",
                                 mesh=self.full_mesh)
        return self.pipeline

    def init(self, params: Any) -> Any:
        """The optimizer state, sharded by the layout's ``opt_state`` rules (:func:`shardings.step.update.init`:
        ``mixed.Scaled`` with a loss scale; ``mixed.Master`` under ``ParamPlan.master``, then :meth:`stored`)."""
        plan = self.plan(params)
        ownership.require_held(params, plan.ownership, self.full_mesh)
        return update.init(self.update_context, plan, params)

    def stored(self, params: Any) -> Any:
        """``params`` as the step stores them between steps: their compute-dtype copy under ``ParamPlan.master``
        (ZeRO-1/2 with a policy: the fp32 master lives in the optimizer state), else ``params`` themselves.

        ``step(params, ...)`` accepts either; a checkpoint's ``like`` must hold what the step returns.
        """
        cast = self.context.cast if self.plan(params).master else mixed.Cast()  # Cast(): no cast
        return tree.map(lambda x: x if ownership.is_absent(x) else cast.to_compute(x), params)

    def master_weights(self, params: Any, opt_state: Any) -> Any:
        """The weights the optimizer updates: the fp32 master (in the ``opt_state`` layout) under
        ``ParamPlan.master``, else ``params``. What the single-device reference's params are compared with."""
        plan, ctx = self.plan(params), self.update_context
        w = update.weights(plan, params, opt_state.opt if ctx.scaler is not None else opt_state)
        return offload.to_device(w, self.mesh.device_mesh.device_type) if plan.master and ctx.offload_opt else w

    def loss_scale(self, opt_state: Any) -> torch.Tensor | None:
        """The loss scale ``opt_state`` carries (``None`` without one): pass it to :meth:`grads`."""
        return opt_state.loss_scale.scale if self.update_context.scaler is not None else None

    def grads(self, params: Any, batch: Any,
              scale: torch.Tensor | None = None) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """``(loss, grads, tokens)``; grads reduced and laid out like the optimizer state. ``scale``
        (:meth:`loss_scale`): backward runs on the loss times it, the grads come back divided by it (infs possible:
        :meth:`apply` skips such a step)."""
        loss, g, tokens = self._grads(params, batch, scale)
        return loss, (g if scale is None else tree.unflatten(self._plan.treedef,
                                                              mixed.unscale(tree.leaves(g), scale))), tokens

    def _grads(self, params: Any, batch: Any, scale: torch.Tensor | None) -> tuple[torch.Tensor, Any, torch.Tensor]:
        plan, ctx = self.plan(params), self.context
        compiling = self.compiled is not None and self.compiled.compiles(ctx.layout, local=plan.local is not None)
        ctx = ctx._replace(compiled=self.compiled.loss_fn) if compiling else ctx
        with self.compiled.running(batch) if compiling else contextlib.nullcontext():
            if ctx.layout.pipelined:
                loss, g, tokens, self.last = pipeline_path.grads(ctx, plan, params, batch, scale)
                return loss, g, tokens
            batch = batching.place(batch, ctx.layout, ctx.mesh, ctx.accum_steps)
            if plan.local is None:
                return dtensor_path.grads(ctx, plan, params, batch, scale)
            rows = [tree.map(lambda x: x.to_local(), mb) for mb in batching.split(batch, ctx.accum_steps)]
            loss, g, tokens = local_step.run(plan.local, ctx.mesh, ctx.run_fn, plan.treedef, tree.leaves(params),
                                             rows, ctx.token_count, ctx.cast, plan.placements["opt_state"], scale)
        return loss, tree.unflatten(plan.treedef, g), tokens

    def apply(self, params: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
        """One optimizer update in the ``opt_state`` layout (:func:`shardings.step.update.apply`); returns params in
        storage layout. With a loss scale, a step whose gradients are not all finite on every rank is skipped:
        params and state come back unchanged and the scale is halved (``core.precision.DynamicLossScale``).
        """
        return update.apply(self.update_context, self.plan(params), params, opt_state, grads)

    def __call__(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, dict[str, Any]]:
        """``(params, opt_state, metrics)`` after one step on ``batch``.

        ``params``: in storage layout (ZeRO-1/2 under a policy: the master weights' compute copy, :meth:`stored`).
        ``metrics``: ``loss``, ``grad_norm``, ``tokens``, ``comm`` and ``comm_bytes`` (the step's collectives),
        ``memory`` (bytes per rank by role; a pipeline stage's: what this rank holds) and, with a pipelined
        layout, ``pipeline`` (:func:`shardings.step.pipeline_path.metrics`).
        """
        self.mesh.device_mesh  # noqa: B018  (no process group: say so first, not comms()'s complaint)
        # Counted: the step's own communication. Metrics (norm, loss, tokens) are reduced after it.
        with accounting.comms() if self.count_comms else contextlib.nullcontext() as c:
            if "params" in self.layout.host:  # they live on the host between steps (offload_params)
                params = offload.to_device(params, self.mesh.device_mesh.device_type)
            scale = self.loss_scale(opt_state)
            loss, grads, tokens = self.grads(params, batch) if scale is None else self.grads(params, batch, scale)
            new_params, new_state = self.apply(params, opt_state, grads)
            if "params" in self.layout.host:
                new_params = offload.to_host(new_params)
        if self._grad_nbytes is None:  # static for a plan
            self._grad_nbytes = held_memory.grad_bytes(self._plan, self.mesh, params, grads)
        scalars = self.scalar_metrics
        metrics = {
            "loss": _scalar(loss) if scalars else None,
            "grad_norm": _scalar(update.grad_norm(self.mesh, self._plan.ownership, grads)) if scalars else None,
            "tokens": int(_scalar(tokens)) if scalars else None,
            "comm": c.rows() if c else None,
            "comm_bytes": c.total_bytes() if c else None,
            "memory": held_memory.roles(new_params, new_state, self._grad_nbytes, self.context.cast.compute,
                                     self.layout.host),
        }
        if self.update_context.scaler is None and scalars:  # fp16's loss scale skips such a step instead (apply)
            finite.check(self.mesh, grads, metrics["grad_norm"])
        if self.pipeline is not None:
            metrics["pipeline"] = pipeline_path.metrics(self.pipeline, self.last)
        return new_params, new_state, metrics

    def gather_stages(self, params: Any) -> Any:
        """Every block as its owner holds it (under ``pp`` on real ranks a broadcast over ``pp`` per leaf, an
        absent block made real first); ``params`` themselves where this process holds every leaf."""
        return ownership.gather_stages(self.plan(params).ownership, params, self.mesh.device_mesh.device_type)


def _check_pipelined(layout: layouts.Layout, loss_fn: Any, plan: Plan | None, mesh: Mesh) -> None:
    """A pipelined layout needs the model's stages as the loss and the run's pipeline plan."""
    if layout.pipelined and not isinstance(loss_fn, Stages):
        raise sharding_error(
            f"layout {layout.name!r} pipelines the model's blocks, but the loss {loss_fn!r} does not declare "
            "its stages", fix="pass the model's stages as the loss, e.g. train_step(models.gpt.stages(cfg), ...)",
            cls=TypeError, mesh=mesh)
    if layout.pipelined and plan is None:
        raise sharding_error(
            f"layout {layout.name!r} pipelines the model's blocks and needs the run's pipeline plan",
            fix="pass plan=shardings.pipeline.plan(layout, mesh, params, schedule=..., microbatches=...) to "
            "train_step (and the same plan to shardings.init)", cls=TypeError, mesh=mesh)


def train_step(loss_fn: Callable[[Any, Any], torch.Tensor], optimizer: Any, *, layout: Any, mesh: Mesh,
               axes: Any = None, accum_steps: int = 1, clip_norm: float | None = None, precision: Any = None,
               token_count: Callable[[Any], torch.Tensor] = default_token_count,
               bucket_mb: float | None = buckets.DEFAULT_BUCKET_MB, local: bool = True,
               count_comms: bool = True, donate: bool = False, plan: Plan | None = None,
               scalar_metrics: bool = True, jit: bool = False,
               jit_backend: str = compiled.DEFAULT_JIT_BACKEND, **gone: Any) -> TrainStep:
    """Build the sharded train step for ``loss_fn(params, batch) -> scalar`` under a layout.

    Args:
        loss_fn: the single-device loss, mean over the batch's tokens.
        optimizer: a ``core.optim.GradientTransformation``.
        layout: a ``Layout`` or preset string (``"zero3+tp+sp"``).
        mesh: the mesh.
        axes: the params' logical names; optional for params made by ``shardings.init``.
        accum_steps: microbatches per step (grads reduced once when the grads role allows).
        clip_norm: clip gradients to this global norm (computed across all shards and axes).
        precision: a ``core.precision.Policy``: params cast to its compute dtype for the loss (ZeRO-1/2 with a
            narrower one: the fp32 master weights live in the optimizer state, :meth:`TrainStep.stored`).
        token_count: ``batch -> tokens`` used to weight microbatches (labels ≠ -100 by default).
        bucket_mb: collectives pack gradients (and ZeRO-3's gathers) into flat buckets of at most this many MB,
            never spanning two blocks, like FSDP per block (``shardings.comm.buckets``); ``None``/``0``: per leaf.
        local: run the loss on local tensors when the layout only splits the batch (``dp``, ZeRO, ``hsdp``;
            ``shardings.step.local_step``); ``False`` keeps DTensors throughout (same results, slower).
        count_comms: count the step's collectives into ``metrics["comm"]``/``["comm_bytes"]`` (a dispatch mode
            that costs time: ``False`` for timing runs, and those metrics are ``None``).
        scalar_metrics: ``False`` leaves ``metrics["loss"]``, ``["grad_norm"]`` and ``["tokens"]`` ``None``: no
            host sync and no norm, for a step on fake tensors (the planner, ``shardings.planner``).
        donate: the step may write the new params and optimizer state into the buffers of those passed in (JAX's
            ``donate_argnums``; ``adamw``'s fused kernel then runs in place): do not use those afterwards.
        plan: with ``pp`` in the layout (required there), the run's :func:`shardings.pipeline.plan`: schedule,
            microbatches (they replace ``accum_steps``) and split, made once where the run is set up; pass the
            same to ``shardings.init``.
        jit: compile the model's compute, block by block, collectives eager around the graphs (torchtitan's
            recipe; :mod:`shardings.step.compiled` says which layouts compile). Real ranks; a fixed batch shape.
        jit_backend: ``torch.compile``'s backend under ``jit`` (default ``shardings.DEFAULT_JIT_BACKEND``):
            ``"inductor"`` (fused kernels) or ``"aot_eager"`` (the same graphs without code generation: tests).

    Raises:
        TypeError: ``schedule``, ``microbatches``, ``stage_sizes`` or ``virtual_stages`` (gone: they make the
            ``plan``); ``pp`` without the model's stages (``models.gpt.stages(cfg)``) as the loss, or without ``plan``.

    Returns:
        A :class:`TrainStep`: ``opt_state = step.init(params)``, then
        ``params, opt_state, metrics = step(params, opt_state, batch)``.

    >>> step = train_step(functools.partial(models.gpt.loss, cfg=cfg), core.optim.adamw(3e-4),
    ...                   layout="zero3+tp", mesh=Mesh(dp=2, tp=2))
    """
    _refuse(gone)
    return TrainStep(loss_fn, optimizer, layout=layout, mesh=mesh, axes=axes, accum_steps=accum_steps,
                     clip_norm=clip_norm, precision=precision, token_count=token_count, bucket_mb=bucket_mb,
                     local=local, count_comms=count_comms, donate=donate, plan=plan, scalar_metrics=scalar_metrics,
                     jit=jit, jit_backend=jit_backend)
