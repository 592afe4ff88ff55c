"""The sharded train step: the layout's tables decide every collective.

One step, for a layout and a mesh:

1. The batch is placed by the ``batch`` rules (each data-parallel rank keeps its rows).
2. Gradients come from one of three paths, chosen from data, not from names:

   - **local** (:mod:`shardings.step.local_step`) when the layout splits only the batch (``dp``, ZeRO, ``hsdp``:
     ``local_step.plan`` finds no model-parallel axis): the loss on plain local tensors, collectives bucketed
     and overlapped with backward, as DDP and FSDP do;
   - **pipeline** (:mod:`shardings.step.pipeline_path`) when the layout pipelines the blocks
     (``Layout.pipelined``): the pipeline plan's schedule over its stages, the other presets in each stage;
   - **DTensor** (:mod:`shardings.step.dtensor_path`) otherwise: the loss on DTensors under
     ``use(mesh, layout)``, parameters gathered from ``params`` (storage) to ``compute`` placements.

   Either way the gradients arrive reduced into the ``opt_state`` placements (replicated there: an all-reduce;
   sharded there: a reduce-scatter).
3. The update is shared (:mod:`shardings.step.update`): clipping to the global norm, the optimizer in the
   ``opt_state`` layout on the leaves this process holds (:mod:`shardings.step.ownership`), new parameters back
   to storage (an all-gather of the updated shards for ZeRO-1/2); under fp16 a step with an inf is skipped.
   Under ZeRO-1/2 with a policy that computes in a narrower dtype than the params', the fp32 master weights are
   part of the optimizer state (``mixed.Master``, sharded with it) and the stored ``params`` are their
   compute-dtype copy (ZeRO's 4P+12P/N and 2P+14P/N): the update runs on the master shard, the all-gather moves
   compute-dtype bytes (:meth:`TrainStep.master_weights`, :meth:`TrainStep.stored`).

The loss is the mean over the global batch's tokens, under any data-parallel or accumulation split:
each microbatch's mean is weighted by its share of the step's tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

import core
from core import tree
from shardings.comm import accounting, buckets, flat_comm
from shardings.pipeline import Plan, Schedule, Split, Stages, plan_for
from shardings.residency import offload
from shardings.runtime.simulate import unwrap
from shardings.spec import layouts, lower
from shardings.spec.errors import sharding_error
from shardings.spec.layouts import PARAM_ROLES
from shardings.spec.mesh import Mesh, P
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
from shardings.step.initialize import param_specs

__all__ = ["ParamPlan", "TrainStep", "default_token_count", "train_step"]


def default_token_count(batch: Any, ignore_index: int = -100) -> torch.Tensor:
    """Tokens a batch contributes to the loss: labels ≠ ``ignore_index``, else the leading dim of the first leaf."""
    if isinstance(batch, dict) and "labels" in batch:
        return (batch["labels"] != ignore_index).sum()
    first = tree.leaves(batch)[0]
    return torch.ones((), dtype=torch.int64) * first.shape[0]


def _scalar(x: torch.Tensor) -> float:
    """A replicated scalar (DTensor or not, simulated or not) as a Python float; simulated ranks must agree."""
    if isinstance(x, DTensor):
        x = x.full_tensor()
    return float(unwrap(x.detach()))


class ParamPlan(NamedTuple):
    """Per-parameter specs for each role, resolved once from the logical axes, and who holds which leaf."""

    specs: dict[str, Any]
    placements: dict[str, list]
    treedef: Any
    local: local_step.LocalPlan | None  # set when the layout runs its loss on local tensors
    units: list[tuple]  # per leaf, its ZeRO-3 gather unit (flat_comm.unit_of: one block)
    ownership: ownership.Ownership  # the leaves this process holds and updates
    master: bool = False  # the optimizer state holds the master weights (mixed.keeps_master: ZeRO-1/2 + policy)


class TrainStep:
    """A pure train step, eager or with its model compute compiled (``jit``). Build with :func:`train_step`."""

    def __init__(self, loss_fn, optimizer, *, layout, mesh, axes=None, accum_steps=1, clip_norm=None,
                 precision=None, token_count=default_token_count, bucket_mb=buckets.DEFAULT_BUCKET_MB, local=True,
                 count_comms=True, donate=False, plan: Plan | None = None, schedule: str | Schedule | None = None,
                 microbatches: int | None = None, stage_sizes: list[int] | None = None,
                 virtual_stages: int | None = None, scalar_metrics: bool = True, jit: bool = False,
                 jit_backend: str = compiled.DEFAULT_JIT_BACKEND):
        if not isinstance(accum_steps, int) or accum_steps < 1:
            raise ValueError(f"train_step: accum_steps must be an int >= 1, got {accum_steps!r}")
        self.layout = layouts.get(layout)
        layouts.validate(self.layout, mesh)
        layouts.warn_idle_axes(self.layout, mesh)  # zero3 on Mesh(dp=2, tp=2): tp idle, said once
        # the pipeline's stages run on the mesh of the other axes; mesh is where parameters live
        self.full_mesh, self.mesh = mesh, mesh.without("pp") if self.layout.pipelined else mesh
        self.loss_fn, self.axes, self.precision, self.token_count = loss_fn, axes, precision, token_count
        self.cast, self.scaler = mixed.Cast.of(precision), precision.scaler if precision is not None else None
        self.bucket_mb, self.count_comms, self.donate = bucket_mb, count_comms, donate
        self.scalar_metrics = scalar_metrics
        self.local = local and not self.layout.pipelined  # the pipeline path runs DTensors in each stage
        self.clip_norm, self.inner = clip_norm, optimizer
        self.clip = core.optim.clip_by_global_norm(clip_norm) if clip_norm is not None else None
        self.optimizer = core.optim.chain(self.clip, optimizer) if self.clip else optimizer
        # the pipeline plan of a pipelined layout: given (checked here), or made from the first params (plan())
        self.pipeline: Plan | None = plan_for(self.layout, mesh, None, plan) if plan is not None else None
        self.last: Any = None  # the last step's pipeline.Result (timeline, P2P, saved activation peaks)
        self._accum_steps = microbatches or accum_steps
        self._pipeline_settings = dict(schedule=schedule, microbatches=microbatches,
                                       accum_steps=accum_steps, virtual_stages=virtual_stages, stage_sizes=stage_sizes,
                                       blocks=getattr(loss_fn, "blocks", "blocks"))
        if self.layout.pipelined and not isinstance(loss_fn, Stages):
            raise sharding_error(
                f"layout {self.layout.name!r} pipelines the model's blocks, but the loss {loss_fn!r} does not declare "
                "its stages", fix="pass the model's stages as the loss, e.g. train_step(models.gpt.stages(cfg), ...)",
                cls=TypeError, mesh=mesh)
        self.compiled = compiled.Compiled(loss_fn, jit_backend, mesh) if jit else None
        self._plan: ParamPlan | None = None
        self._grad_nbytes: int | None = None
        self.offload_opt = "opt_state" in self.layout.host
        if self.offload_opt and not getattr(optimizer, "elementwise", False):
            raise sharding_error(
                f"layout {self.layout.name!r} keeps the optimizer state in host memory, and the update runs there "
                f"on each rank's blocks, which needs an elementwise optimizer; this one is not",
                fix="use core.optim.adamw/adam/sgd (or drop offload_optimizer from the layout)", mesh=mesh)

    # -- planning ---------------------------------------------------------------------------------
    def plan(self, params: Any) -> ParamPlan:
        """Specs and placements of every parameter for each role, and who holds which (cached after the first
        call; with a pipelined layout and no plan given, the pipeline plan is made here from ``params``)."""
        if self._plan is None:
            self.pipeline = plan_for(self.layout, self.full_mesh, params, self.pipeline, **self._pipeline_settings)
            axes = self.axes if self.axes is not None else _recorded_axes(params)
            specs = {r: param_specs(axes, params, self.layout, self.mesh, role=r) for r in PARAM_ROLES}
            flat = {r: tree.leaves(specs[r], is_leaf=lambda s: isinstance(s, P)) for r in PARAM_ROLES}
            placements = {
                r: [lower.to_placements(s, self.mesh, len(p.shape)) for s, p in zip(flat[r], tree.leaves(params))]
                for r in PARAM_ROLES
            }
            units = [flat_comm.unit_of(path) for path, _ in tree.leaves_with_path(params)]
            local = self.local and local_step.plan(placements, tree.leaves(params), self.layout, self.mesh,
                                                   self.bucket_mb, units)
            held = ownership.ownership(self.pipeline, params, self.full_mesh)
            master = mixed.keeps_master(self.cast, tree.leaves(params), placements, self.mesh)
            self._plan = ParamPlan(specs, placements, tree.structure(params), local or None, units, held, master)
        return self._plan

    @property
    def accum_steps(self) -> int:
        """Microbatches per step: the pipeline plan's under ``pp``."""
        return self.pipeline.microbatches if self.pipeline is not None else self._accum_steps

    def _made_pipeline(self) -> Plan:
        if self.pipeline is None:
            what = "made from the params on the first init or step" if self.layout.pipelined else "none: no pp"
            raise sharding_error(f"layout {self.layout.name!r}: the pipeline plan is {what}",
                                 fix="pass plan=shardings.pipeline.plan(...) to train_step, or call step.split(params) "
                                 "first", mesh=self.full_mesh)
        return self.pipeline

    @property
    def schedule(self) -> Schedule:
        """The pipeline plan's schedule (``print(step.schedule)``: each rank's actions in time)."""
        return self._made_pipeline().schedule

    def split(self, params: Any) -> Split:
        """Which blocks each stage runs (``print(step.split(params))``), from the pipeline plan."""
        self.plan(params)
        return self._made_pipeline().split

    # -- public API -------------------------------------------------------------------------------
    def init(self, params: Any) -> Any:
        """The optimizer state, sharded by the layout's ``opt_state`` rules; with a loss scale (fp16),
        ``mixed.Scaled(loss_scale, opt)``.

        Under ZeRO-1/2 with a policy whose compute dtype is narrower than the params' (``ParamPlan.master``), the
        state is ``mixed.Master(weights, opt)``: a copy of ``params`` in the ``opt_state`` layout is the master
        weights, and the step's params are from then on their compute-dtype copy (:meth:`stored`).
        """
        plan = self.plan(params)
        ownership.require_held(params, plan.ownership, self.full_mesh)
        with torch.no_grad():
            placed = [x.redistribute(x.device_mesh, pl) for x, pl in
                      zip(tree.leaves(params), plan.placements["opt_state"])]
            state = self.optimizer.init(tree.unflatten(plan.treedef, placed))
            if plan.master:  # copies: the params' storage is not kept alive by a view, nor written by a donation
                state = mixed.Master(tree.unflatten(plan.treedef, [x.clone() for x in placed]), state)
        if self.offload_opt:
            state = offload.to_host(state)
        return mixed.Scaled(self.scaler.init(), state) if self.scaler is not None else state

    def stored(self, params: Any) -> Any:
        """``params`` as the step stores them between steps: their compute-dtype copy under ``ParamPlan.master``
        (ZeRO-1/2 with a policy: the fp32 master lives in the optimizer state), else ``params`` themselves.

        ``step(params, ...)`` accepts either; a checkpoint's ``like`` must hold what the step returns.
        """
        if not self.plan(params).master:
            return params
        return tree.map(lambda x: x if ownership.is_absent(x) else self.cast.to_compute(x), params)

    def master_weights(self, params: Any, opt_state: Any) -> Any:
        """The weights the optimizer updates: the fp32 master (in the ``opt_state`` layout) under
        ``ParamPlan.master``, else ``params``. What the single-device reference's params are compared with."""
        plan = self.plan(params)
        w = update.weights(plan, params, opt_state.opt if self.scaler is not None else opt_state)
        return offload.to_device(w, self.mesh.device_mesh.device_type) if plan.master and self.offload_opt else w

    def loss_scale(self, opt_state: Any) -> torch.Tensor | None:
        """The loss scale ``opt_state`` carries (``None`` without one): pass it to :meth:`grads`."""
        return opt_state.loss_scale.scale if self.scaler is not None else None

    def grads(self, params: Any, batch: Any,
              scale: torch.Tensor | None = None) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """``(loss, grads, tokens)``; grads are reduced and laid out like the optimizer state.

        ``scale`` (:meth:`loss_scale`): backward runs on the loss times it; the grads returned are divided
        by it again (they may hold infs: :meth:`apply` skips such a step).
        """
        loss, g, tokens = self._grads(params, batch, scale)
        return loss, (g if scale is None else tree.unflatten(self._plan.treedef,
                                                              mixed.unscale(tree.leaves(g), scale))), tokens

    def _grads(self, params: Any, batch: Any, scale: torch.Tensor | None) -> tuple[torch.Tensor, Any, torch.Tensor]:
        plan = self.plan(params)
        compiling = self.compiled is not None and self.compiled.compiles(self.layout, local=plan.local is not None)
        with self.compiled.running(batch) if compiling else contextlib.nullcontext():
            if self.layout.pipelined:
                return pipeline_path.grads(self, plan, params, batch, scale, compiling)
            batch = self.place_batch(batch)
            if plan.local is None:
                return dtensor_path.grads(self, plan, params, batch, scale, compiling)
            rows = [tree.map(lambda x: x.to_local(), mb) for mb in self.microbatches(batch)]
            loss_fn = self.compiled.loss_fn if self.compiled else self.loss_fn
            loss, g, tokens = local_step.run(plan.local, self.mesh, loss_fn, plan.treedef, tree.leaves(params),
                                             rows, self.token_count, self.cast, plan.placements["opt_state"], scale)
        return loss, tree.unflatten(plan.treedef, g), tokens

    def apply(self, params: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
        """One optimizer update in the ``opt_state`` layout (:func:`shardings.step.update.update`); returns params in
        storage layout.

        With a loss scale, a step whose gradients are not all finite on every rank is skipped: params and
        the optimizer state come back unchanged and the scale is halved (``core.precision.DynamicLossScale``).
        """
        # a reduce dtype narrower than the params': clipping and the optimizer run in fp32 on the fp32 master
        # weights (one transient fp32 copy of the rank's gradients)
        plan = self.plan(params)
        master = update.weights(plan, params, opt_state.opt if self.scaler is not None else opt_state)
        grads = tree.map(lambda g, p: g.to(p.dtype) if g.dtype != p.dtype else g, grads, master)
        if self.scaler is None:
            return update.update(self, plan, params, opt_state, grads)
        ok = mixed.finite(self.mesh, tree.leaves(grads))
        scale = self.scaler.adjust(opt_state.loss_scale, ok)
        if not ok:
            return params, mixed.Scaled(scale, opt_state.opt)
        params, state = update.update(self, plan, params, opt_state.opt, grads)
        return params, mixed.Scaled(scale, state)

    def __call__(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, dict[str, Any]]:
        """``(params, opt_state, metrics)`` after one step on ``batch``.

        ``params``: in storage layout; under ZeRO-1/2 with a narrower compute dtype, the compute-dtype copy of the
        master weights, which live in ``opt_state`` (:meth:`master_weights`).

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
            "grad_norm": _scalar(update.grad_norm(self, self._plan.ownership, grads)) if scalars else None,
            "tokens": int(_scalar(tokens)) if scalars else None,
            "comm": c.rows() if c else None,
            "comm_bytes": c.total_bytes() if c else None,
            "memory": held_memory.roles(new_params, new_state, self._grad_nbytes, self.cast.compute, self.layout.host),
        }
        if self.scaler is None and scalars:  # fp16's loss scale skips such a step instead (apply)
            finite.check(self.mesh, grads, metrics["grad_norm"])
        if self.pipeline is not None:
            metrics["pipeline"] = pipeline_path.metrics(self.pipeline, self.last)
        return new_params, new_state, metrics

    def gather_stages(self, params: Any) -> Any:
        """Every block as its owner holds it (under ``pp`` on real ranks a broadcast over ``pp`` per leaf, an
        absent block made real first); ``params`` themselves where this process holds every leaf."""
        return ownership.gather_stages(self.plan(params).ownership, params, self.mesh.device_mesh.device_type)

    # -- pieces -----------------------------------------------------------------------------------
    def place_batch(self, batch: Any) -> Any:
        """``batch`` placed by the layout's ``batch`` rules (each data-parallel rank keeps its rows)."""
        return batching.place(batch, self.layout, self.mesh, self.accum_steps)

    def microbatches(self, batch: Any) -> list[Any]:
        """A placed batch split into the step's microbatches (each rank splits its own rows)."""
        return batching.split(batch, self.accum_steps)


def _recorded_axes(params: Any) -> Any:
    # Per parameter, not per name: a None *inside* a names tuple is a replicated dim, not a missing record.
    recorded = [getattr(p, "_logical_names", None) for p in tree.leaves(params)]
    if any(names is None for names in recorded):
        raise sharding_error(
            "train_step cannot tell the logical axes of the params (they were not made by shardings.init)",
            fix="pass axes=model.axes(cfg) to train_step",
            cls=TypeError,
        )
    return tree.unflatten(tree.structure(params), recorded)


def train_step(loss_fn: Callable[[Any, Any], torch.Tensor], optimizer: Any, *, layout: Any, mesh: Mesh,
               axes: Any = None, accum_steps: int = 1, clip_norm: float | None = None, precision: Any = None,
               token_count: Callable[[Any], torch.Tensor] = default_token_count,
               bucket_mb: float | None = buckets.DEFAULT_BUCKET_MB, local: bool = True,
               count_comms: bool = True, donate: bool = False, plan: Plan | None = None,
               microbatches: int | None = None, schedule: str | Schedule | None = None,
               stage_sizes: list[int] | None = None, virtual_stages: int | None = None,
               scalar_metrics: bool = True, jit: bool = False,
               jit_backend: str = compiled.DEFAULT_JIT_BACKEND) -> TrainStep:
    """Build the sharded train step for ``loss_fn(params, batch) -> scalar`` under a layout.

    Args:
        loss_fn: the single-device loss, mean over the batch's tokens.
        optimizer: a ``core.optim.GradientTransformation``.
        layout: a ``Layout`` or preset string (``"zero3+tp+sp"``).
        mesh: the mesh.
        axes: the params' logical names; optional for params made by ``shardings.init``.
        accum_steps: microbatches per step (grads reduced once when the grads role allows).
        clip_norm: clip gradients to this global norm (computed across all shards and axes).
        precision: a ``core.precision.Policy``; params are cast to its compute dtype for the loss. Under ZeRO-1/2
            with a compute dtype narrower than the params', the optimizer state keeps the fp32 master weights
            sharded with it, and the step returns the params as their replicated compute-dtype copy.
        token_count: ``batch -> tokens`` used to weight microbatches (labels ≠ -100 by default).
        bucket_mb: gradients all-reduced after backward are packed into flat buckets of this many MB,
            one collective per bucket (``shardings.comm.buckets``); ``None`` or ``0``: one per gradient.
            ZeRO-3 gathers (and reduce-scatters) in buckets of at most this size that never span two
            blocks (leaves under different list indices, ``params["blocks"][i]``), like FSDP per block;
            backward re-gathers a block's, and keeps the rest's (embedding, norm) from forward, like FSDP2's root.
        local: run the loss on local tensors when the layout only splits the batch (``dp``, ZeRO,
            ``hsdp``): collectives bucketed and overlapped with backward (``shardings.step.local_step``).
            ``False`` keeps DTensors throughout (same results, slower).
        count_comms: count the step's collectives into ``metrics["comm"]``/``["comm_bytes"]``
            (``shardings.comms()``, a dispatch mode that sees every op: it costs time; ``False``
            for timing runs, and those metrics are ``None``).
        scalar_metrics: ``False`` leaves ``metrics["loss"]``, ``["grad_norm"]`` and ``["tokens"]`` ``None``: no
            host sync and no norm, for a step on fake tensors (the planner, ``shardings.planner``).
        donate: the step may write the new params and optimizer state into the buffers of the ones
            passed in (JAX's ``donate_argnums``): do not use those afterwards. With ``local`` and an
            optimizer that has a ``fused_step`` (``adamw``), the update then runs in torch's fused
            kernel on local shards in place; without donation it runs on copies.
        plan: with ``pp`` in the layout, the run's :func:`shardings.pipeline.plan` (schedule, microbatches and
            split, made once where the run is set up; pass the same to ``shardings.init``). Without it the
            four keywords below make one from the first params the step sees.
        microbatches: with ``pp`` and no ``plan``: the pipeline's microbatches per step (default ``accum_steps``,
            or the ``pp`` size when that is 1); otherwise another name for ``accum_steps``.
        schedule: with ``pp`` and no ``plan``: a name from ``shardings.pipeline.SCHEDULES`` (default
            ``shardings.pipeline.DEFAULT_SCHEDULE``) or a checked ``shardings.pipeline.Schedule``.
        stage_sizes: with ``pp`` and no ``plan``: blocks per stage (default: balanced by parameter count,
            ``pipeline.split``); a schedule with v stages per rank has ``pp·v`` stages.
        virtual_stages: with ``pp`` and no ``plan``: stages per rank for a schedule that lets the caller choose
            (``interleaved_1f1b``, default 2).
        jit: compile the model's compute (:mod:`shardings.step.compiled`): each block of a loss that declares its
            blocks (``models.gpt.stages(cfg)``) one ``torch.compile``d graph, or the whole loss; the collectives stay
            eager and overlapped around the graphs (torchtitan's per-block recipe). Layouts of ``dp``, ZeRO,
            ``hsdp``, ``tp``, ``sp``, ``cp`` and ``ep`` compile (tp/sp/cp/ep collectives inside the graphs), and under
            ``pp`` each stage's blocks, under every schedule; offload and hand-made layouts on the DTensor path run
            eagerly with a :class:`~shardings.step.compiled.CompileFallbackWarning`. Needs real ranks
            (``shardings.launch``).
            The batch shape must stay fixed; a recompile after the warm-up steps raises a ``ShardingError``.
        jit_backend: ``torch.compile``'s backend under ``jit``: ``"inductor"`` (fused kernels) or ``"aot_eager"``
            (the same graphs without code generation: quick to compile, for tests).

    With ``pp`` the loss must be the model's ``Stages`` (``models.gpt.stages(cfg)``):
    :mod:`shardings.step.pipeline_path`.

    Returns:
        A :class:`TrainStep`: ``opt_state = step.init(params)``, then
        ``params, opt_state, metrics = step(params, opt_state, batch)``.

    >>> step = train_step(functools.partial(models.gpt.loss, cfg=cfg), core.optim.adamw(3e-4),
    ...                   layout="zero3+tp", mesh=Mesh(dp=2, tp=2))
    """
    return TrainStep(loss_fn, optimizer, layout=layout, mesh=mesh, axes=axes, accum_steps=accum_steps,
                     clip_norm=clip_norm, precision=precision, token_count=token_count, bucket_mb=bucket_mb,
                     local=local, count_comms=count_comms, donate=donate, plan=plan, schedule=schedule,
                     microbatches=microbatches, stage_sizes=stage_sizes, virtual_stages=virtual_stages,
                     scalar_metrics=scalar_metrics, jit=jit, jit_backend=jit_backend)
