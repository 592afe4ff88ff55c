"""The sharded train step: the layout's tables decide every collective.

One step, for a layout and a mesh:

1. The batch is placed by the ``batch`` rules (each data-parallel rank keeps its rows).
2. Parameters go from ``params`` (storage) to ``compute`` placements: for ZeRO-3 an all-gather,
   re-gathered in backward rather than kept (``gather_params``).
3. ``loss_fn`` runs under ``use(mesh, layout)``, so its ``constrain`` calls resolve. Gradients of
   replicated parameters come out ``Partial`` (unreduced).
4. Gradients are reduced straight into the ``opt_state`` placements — replicated there: an
   all-reduce (DP; one per bucket of flattened gradients, ``shardings.comm.buckets``); sharded there: a
   reduce-scatter (ZeRO). A ``grads`` role that is sharded means "never hold full gradients":
   each gradient is reduced as soon as backward produces it.
   Otherwise gradients stay ``Partial`` across accumulation microbatches and are reduced once.
5. The optimizer updates in the ``opt_state`` layout; new parameters go back to storage
   (an all-gather of the updated shards for ZeRO-1/2).

The loss is the mean over the global batch's tokens, under any data-parallel or accumulation split:
each microbatch's mean is weighted by its share of the step's tokens.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

import core
from core import tree
from shardings.comm import accounting, buckets, flat_comm
from shardings.ops.module_tp import dtensor_errors
from shardings.residency import gather_buckets, offload
from shardings.residency.gather_params import regather_in_backward
from shardings.runtime.simulate import unwrap
from shardings.spec import layouts, lower
from shardings.spec.context import use
from shardings.spec.errors import sharding_error
from shardings.spec.mesh import Mesh, P
from shardings.step import batching, local_step, mixed
from shardings.step.initialize import param_specs

__all__ = ["TrainStep", "default_token_count", "train_step"]

_ROLES = ("params", "compute", "grads", "opt_state")


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


class Plan(NamedTuple):
    """Per-parameter specs for each role, resolved once from the logical axes."""

    specs: dict[str, Any]
    placements: dict[str, list]
    treedef: Any
    local: local_step.LocalPlan | None  # set when the layout runs its loss on local tensors
    units: list[tuple]  # per leaf, its ZeRO-3 gather unit (flat_comm.unit_of: one block)


class TrainStep:
    """A jit-free, pure train step. Build with :func:`train_step`."""

    def __init__(self, loss_fn, optimizer, *, layout, mesh, axes=None, accum_steps=1, clip_norm=None,
                 precision=None, token_count=default_token_count, bucket_mb=buckets.DEFAULT_BUCKET_MB, local=True,
                 count_comms=True, donate=False, scalar_metrics=True):
        if not isinstance(accum_steps, int) or accum_steps < 1:
            raise ValueError(f"train_step: accum_steps must be an int >= 1, got {accum_steps!r}")
        self.loss_fn, self.mesh, self.axes = loss_fn, mesh, axes
        self.layout = layouts.get(layout)
        layouts.validate(self.layout, mesh)
        self.accum_steps, self.precision, self.token_count = accum_steps, precision, token_count
        self.cast, self.scaler = mixed.Cast.of(precision), precision.scaler if precision is not None else None
        self.bucket_mb, self.local, self.count_comms, self.donate = bucket_mb, local, count_comms, donate
        self.scalar_metrics = scalar_metrics
        self._clip = core.optim.clip_by_global_norm(clip_norm) if clip_norm is not None else None
        self._inner = optimizer
        self.optimizer = core.optim.chain(self._clip, optimizer) if self._clip else optimizer
        self._plan: Plan | None = None
        self._grad_nbytes: int | None = None
        self._offload_opt = "opt_state" in self.layout.host
        if self._offload_opt and not getattr(optimizer, "elementwise", False):
            raise sharding_error(
                f"layout {self.layout.name!r} keeps the optimizer state in host memory, and the update runs there "
                f"on each rank's blocks, which needs an elementwise optimizer; this one is not",
                fix="use core.optim.adamw/adam/sgd (or drop offload_optimizer from the layout)", mesh=mesh)

    # -- planning ---------------------------------------------------------------------------------
    def plan(self, params: Any) -> Plan:
        """Specs and placements of every parameter for each role (cached after the first call)."""
        if self._plan is None:
            axes = self.axes if self.axes is not None else _recorded_axes(params)
            specs = {r: param_specs(axes, params, self.layout, self.mesh, role=r) for r in _ROLES}
            flat = {r: tree.leaves(specs[r], is_leaf=lambda s: isinstance(s, P)) for r in _ROLES}
            placements = {
                r: [lower.to_placements(s, self.mesh, len(p.shape)) for s, p in zip(flat[r], tree.leaves(params))]
                for r in _ROLES
            }
            units = [flat_comm.unit_of(path) for path, _ in tree.leaves_with_path(params)]
            local = self.local and local_step.plan(placements, tree.leaves(params), self.layout, self.mesh,
                                                   self.bucket_mb, units)
            self._plan = Plan(specs, placements, tree.structure(params), local or None, units)
        return self._plan

    def _to(self, role: str, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        dm = self.mesh.device_mesh
        return [x.redistribute(dm, pl) for x, pl in zip(leaves, self._plan.placements[role])]

    # -- public API -------------------------------------------------------------------------------
    def init(self, params: Any) -> Any:
        """The optimizer state, sharded by the layout's ``opt_state`` rules; with a loss scale (fp16),
        ``mixed.Scaled(loss_scale, opt)``."""
        self.plan(params)
        with torch.no_grad():
            state = self.optimizer.init(tree.unflatten(self._plan.treedef, self._to("opt_state", tree.leaves(params))))
        if self._offload_opt:
            state = offload.to_host(state)
        return mixed.Scaled(self.scaler.init(), state) if self.scaler is not None else state

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
        batch = self._place_batch(batch)
        if plan.local is not None:
            rows = [tree.map(lambda x: x.to_local(), mb) for mb in self._microbatches(batch)]
            loss, g, tokens = local_step.run(plan.local, self.mesh, self.loss_fn, plan.treedef, tree.leaves(params),
                                             rows, self.token_count, self.cast, plan.placements["opt_state"], scale)
            return loss, tree.unflatten(plan.treedef, g), tokens
        leaves = [p.detach().requires_grad_(True) for p in tree.leaves(params)]
        reduce_now = self._reduce_in_backward()
        hooks = [p.register_hook(self._reducer(i)) for i, p in enumerate(leaves) if reduce_now[i]]
        total_tokens = self.token_count(batch)
        loss_sum, acc = None, None
        try:
            for mb in self._microbatches(batch):
                weight = self.token_count(mb) / total_tokens
                with use(self.mesh, self.layout), regather_in_backward(), dtensor_errors():
                    compute, gathers = gather_buckets.gather(leaves, plan.placements["compute"], self.bucket_mb,
                                                             plan.units, self.cast)
                    compute = self._cast_compute(compute)
                    loss = self.loss_fn(tree.unflatten(plan.treedef, compute), mb) * weight
                    del compute
                    gathers.close()  # forget every gathered bucket: autograd holds what backward needs
                    scaled = loss if scale is None else loss * scale
                    g = gather_buckets.settle(torch.autograd.grad(scaled, leaves, allow_unused=True), gathers)
                g = [self.cast.to_reduce(torch.zeros_like(p) if gi is None else gi) for p, gi in zip(leaves, g)]
                acc = g if acc is None else [a + b for a, b in zip(acc, g)]
                loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        finally:
            for h in hooks:
                h.remove()
        # Partial -> replicated: all-reduce (one per bucket); -> sharded: reduce-scatter (per leaf).
        reduced = buckets.reduce(acc, plan.placements["opt_state"], self.bucket_mb)
        return loss_sum, tree.unflatten(plan.treedef, reduced), total_tokens

    def apply(self, params: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
        """One optimizer update in the ``opt_state`` layout; returns params in storage layout.

        With a loss scale, a step whose gradients are not all finite on every rank is skipped: params and
        the optimizer state come back unchanged and the scale is halved (``core.precision.DynamicLossScale``).
        """
        # a reduce dtype narrower than the params': clipping and the optimizer run in fp32 on the fp32 master
        # weights (one transient fp32 copy of the rank's gradients)
        grads = tree.map(lambda g, p: g.to(p.dtype) if g.dtype != p.dtype else g, grads, params)
        if self.scaler is None:
            return self._update(params, opt_state, grads)
        ok = mixed.finite(self.mesh, tree.leaves(grads))
        scale = self.scaler.adjust(opt_state.loss_scale, ok)
        if not ok:
            return params, mixed.Scaled(scale, opt_state.opt)
        params, state = self._update(params, opt_state.opt, grads)
        return params, mixed.Scaled(scale, state)

    def _update(self, params: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
        """The optimizer's update (:meth:`apply` without the loss scale's skip); grads in the params' dtype.

        An elementwise optimizer (``adamw``, ``sgd``, ...) updates each rank's local blocks
        (``local_step.update_blocks``: torch's fused kernel where it has one, in place when donated),
        after a clip's global norm on the DTensors; any other runs its pure update on the DTensors.
        """
        plan = self.plan(params)
        if not getattr(self._inner, "elementwise", False):
            with torch.no_grad():
                p_opt = tree.unflatten(plan.treedef, self._to("opt_state", tree.leaves(params)))
                updates, opt_state = self.optimizer.update(grads, opt_state, p_opt)
                new = tree.leaves(core.optim.apply_updates(p_opt, updates))
                return tree.unflatten(plan.treedef, self._to("params", new)), opt_state
        with torch.no_grad():
            if self._clip is not None:
                grads, inner_state = self._clip.update(grads, opt_state[0])[0], opt_state[1]
            else:
                inner_state = opt_state
            opt_pl, leaves = plan.placements["opt_state"], tree.leaves(params)
            if plan.local is not None:
                new, inner_state = local_step.apply(plan.local, self.mesh, self._inner, plan.treedef, leaves,
                                                    inner_state, tree.leaves(grads), opt_pl,
                                                    plan.placements["params"], donate=self.donate,
                                                    offload=self._offload_opt)
            else:
                p_opt = self._to("opt_state", leaves)
                blocks, inner_state = local_step.update_blocks(self._inner, plan.treedef, [p.to_local() for p in p_opt],
                                                               inner_state, tree.leaves(grads), self.donate,
                                                               self._offload_opt)
                dm = self.mesh.device_mesh
                new = self._to("params", [flat_comm.dtensor(x, dm, pl, p) for x, p, pl in zip(blocks, p_opt, opt_pl)])
        state = (opt_state[0], inner_state) if self._clip is not None else inner_state
        return tree.unflatten(plan.treedef, new), state

    def __call__(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, dict[str, Any]]:
        """``(params, opt_state, metrics)`` after one step on ``batch``."""
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
        scalars = self.scalar_metrics
        metrics = {
            "loss": _scalar(loss) if scalars else None,
            "grad_norm": _scalar(self._grad_norm(grads)) if scalars else None,
            "tokens": int(_scalar(tokens)) if scalars else None,
            "comm": c.rows() if c else None,
            "comm_bytes": c.total_bytes() if c else None,
            "memory": {
                "params": accounting.memory(new_params),
                "compute": self._compute_copy_bytes(new_params),
                "grads": self._grad_bytes(params, grads),
                "opt_state": accounting.memory(new_state),
                "host": sum(accounting.memory(t) for r, t in (("params", new_params), ("opt_state", new_state))
                            if r in self.layout.host),
            },
        }
        return new_params, new_state, metrics

    # -- pieces -----------------------------------------------------------------------------------
    def _grad_norm(self, grads: Any) -> torch.Tensor:
        norm = local_step.global_norm(self.mesh, tree.leaves(grads))  # local blocks, a few scalar all-reduces
        return core.optim.global_norm(grads) if norm is None else norm

    def _reduce_in_backward(self) -> list[bool]:
        # A sharded grads role: reduce each gradient as backward produces it (ZeRO-2/3 memory).
        # A gradient whose compute placement differs from storage is reduced by the gather's backward.
        pl = self._plan.placements
        return [g != c and c == s for g, c, s in zip(pl["grads"], pl["compute"], pl["params"])]

    def _reducer(self, i: int) -> Callable[[torch.Tensor], torch.Tensor]:
        placements, cast = self._plan.placements["grads"][i], self.cast
        return lambda g: cast.to_reduce(g).redistribute(g.device_mesh, placements).to(g.dtype)

    def _grad_bytes(self, params: Any, grads: Any) -> int:
        # Gradients held per rank: reduced in backward (a sharded grads role) they take the grads
        # layout; otherwise backward leaves them whole-per-rank in the compute layout until reduced.
        # Static for a plan: shapes, specs and dtypes do not change between steps.
        if self._grad_nbytes is None:
            plan, total = self._plan, 0
            specs = {r: tree.leaves(plan.specs[r], is_leaf=lambda s: isinstance(s, P)) for r in ("grads", "compute")}
            reduce_now = self._reduce_in_backward()
            for i, (p, g) in enumerate(zip(tree.leaves(params), tree.leaves(grads))):
                gathered = plan.placements["compute"][i] != plan.placements["params"][i]
                spec = specs["grads" if reduce_now[i] or gathered else "compute"][i]
                dims = spec.dim_axes() + ((),) * p.ndim
                total += math.prod(-(-n // self.mesh.axis_size(a)) for n, a in zip(p.shape, dims)) * g.element_size()
            self._grad_nbytes = total
        return self._grad_nbytes

    def _compute_copy_bytes(self, params: Any) -> int:
        """Bytes of the compute-dtype copies of the params each rank makes (its stored blocks, cast before any
        gather): 0 without a policy or when compute dtype is the params' own."""
        dtype = self.cast.compute
        if dtype is None:
            return 0
        held = [p for p in tree.leaves(params) if p.is_floating_point() and p.dtype != dtype]
        return accounting.memory(held) * dtype.itemsize // max(1, held[0].dtype.itemsize) if held else 0

    def _cast_compute(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self.cast.to_compute(x) for x in leaves]

    def _place_batch(self, batch: Any) -> Any:
        return batching.place(batch, self.layout, self.mesh, self.accum_steps)

    def _microbatches(self, batch: Any) -> list[Any]:
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
               count_comms: bool = True, donate: bool = False, scalar_metrics: bool = True,
               microbatches: int | None = None,
               schedule: Any = "1f1b", stage_sizes: list[int] | None = None,
               virtual_stages: int | None = None) -> TrainStep:
    """Build the sharded train step for ``loss_fn(params, batch) -> scalar`` under a layout.

    Args:
        loss_fn: the single-device loss, mean over the batch's tokens.
        optimizer: a ``core.optim.GradientTransformation``.
        layout: a ``Layout`` or preset string (``"zero3+tp+sp"``).
        mesh: the mesh.
        axes: the params' logical names; optional for params made by ``shardings.init``.
        accum_steps: microbatches per step (grads reduced once when the grads role allows).
        clip_norm: clip gradients to this global norm (computed across all shards and axes).
        precision: a ``core.precision.Policy``; params are cast to its compute dtype for the loss.
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
        microbatches: with ``pp`` in the layout, the pipeline's microbatches per step (default ``accum_steps``,
            or the ``pp`` size when that is 1); otherwise another name for ``accum_steps``.
        schedule: with ``pp``: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zb_h1"``, ``"zb_v"`` or a
            checked ``shardings.pipeline.Schedule``.
        stage_sizes: with ``pp``: blocks per stage (default: balanced by parameter count, ``pipeline.split``);
            a schedule with v stages per rank has ``pp·v`` stages.
        virtual_stages: with ``pp`` and ``schedule="interleaved_1f1b"``: model chunks per rank (default 2).

    With ``pp`` the loss must be the model's ``Stages`` (``models.gpt.stages(cfg)``):
    :mod:`shardings.step.pipeline_step`.

    Returns:
        A :class:`TrainStep`: ``opt_state = step.init(params)``, then
        ``params, opt_state, metrics = step(params, opt_state, batch)``.

    >>> step = train_step(functools.partial(models.gpt.loss, cfg=cfg), core.optim.adamw(3e-4),
    ...                   layout="zero3+tp", mesh=Mesh(dp=2, tp=2))
    """
    from shardings.step.pipeline_step import PipelineStep, has_pp

    kw = dict(axes=axes, clip_norm=clip_norm, precision=precision, token_count=token_count, bucket_mb=bucket_mb,
              count_comms=count_comms, donate=donate, scalar_metrics=scalar_metrics)
    if has_pp(layout):
        m = microbatches or (accum_steps if accum_steps > 1 else mesh.axis_size("pp"))
        return PipelineStep(loss_fn, optimizer, layout=layout, mesh=mesh, microbatches=m, schedule=schedule,
                            stage_sizes=stage_sizes, virtual_stages=virtual_stages, **kw)
    return TrainStep(loss_fn, optimizer, layout=layout, mesh=mesh, accum_steps=microbatches or accum_steps,
                     local=local, **kw)
