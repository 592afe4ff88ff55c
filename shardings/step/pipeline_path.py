"""The pipeline path: gradients from a schedule across stages, the other presets inside each stage.

``"layers" → "pp"`` (preset ``pp``) puts a model's blocks on the mesh axis ``pp``. Each stage runs on
the mesh of the other axes as this rank sees it (``mesh.without("pp")``: the slice holding it), with
the rest of the layout (the presets registered to compose with ``pp``: the data presets ``dp``/``zero1``/
``zero2``/``zero3``/``hsdp``, ``tp``, ``sp``, ``cp``/``cp_allgather``, ``ep``) applied there as usual: params,
batch and activations are DTensors on the stage mesh. The batch is split into the plan's microbatches (each
data-parallel rank splits its own rows), its schedule (any of ``shardings.pipeline.SCHEDULES`` or a checked
:class:`~shardings.pipeline.Schedule`) runs them through the stages (:func:`shardings.pipeline.run`),
gradients accumulate over microbatches and are reduced once per step over the data axes (``no_sync``),
the loss is the global token mean, and clipping sees every stage's gradients (``shardings.step.update``).

On simulated ranks every stage runs in this process (the stage mesh's DTensors then hold the same
values on the ranks of every stage). On real processes each rank runs its own stage's actions and
carries travel as local blocks over the ``pp`` group (laid out on arrival by the model's
``Stages.carry_names``). A rank holds only its own stage's blocks (:mod:`shardings.step.ownership`):
``shardings.init`` leaves the other blocks absent (meta-device DTensors), and gradients, optimizer state
and the update cover the rank's own leaves. The parameters outside the blocks (embedding, final norm, head:
used by the first and the last stage) are held by every rank and their gradients summed over ``pp``.
``TrainStep.gather_stages`` fetches each block from the rank that owns it.

**ZeRO-3 (and HSDP) inside a stage: gathered once per step.** Before the schedule runs, a rank gathers
its stage's weights into their compute layout (one all-gather per bucket, never mixing two blocks:
:func:`~shardings.residency.gather_buckets.gather`), and every microbatch's forward and backward use
them; gradients accumulate unreduced over the microbatches and are reduce-scattered once at the end.
So a step has as many all-gathers (and reduce-scatters) whatever the microbatch count ``m``, each moving
``(N−1)/N`` of the stage's weights: ZeRO-2's volume. Gathering per microbatch instead (FSDP's per-block
gather, re-gathered in backward) would keep one block gathered at a time but cost ``2m`` all-gathers per
block per step, and under 1F1B a stage alternates forwards and backwards of different microbatches in its
steady state, so its blocks are needed almost all the step anyway (torchtitan turns FSDP's reshard after
forward off under pp for the same reason). The price is memory during the step: the stage's whole
weights in their compute layout (``4·P_s/t`` bytes in fp32 for ``P_s`` stage parameters under ``tp=t``,
instead of one block's) from the first forward to the last backward, next to the unreduced gradients
(``4·P_s/t``, as every data preset under pp holds them: ``no_sync``). Between steps a rank keeps ZeRO-3's
``16·P_s/N``; the in-step peak is ZeRO-2's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

from core import tree
from shardings.comm import buckets
from shardings.ops.module_tp import dtensor_errors
from shardings.pipeline import Plan, Result, Stages, cut, run, seq_length
from shardings.residency import gather_buckets
from shardings.runtime.compat import implicit_replication
from shardings.spec import lower
from shardings.spec.context import use
from shardings.spec.layouts import Layout
from shardings.spec.mesh import Mesh
from shardings.spec.placeholder import resolve
from shardings.spec.rules import is_names, logical_to_spec
from shardings.step import batching, ownership
from shardings.step.context import GradContext, ParamPlan
from shardings.step.ownership import absent

__all__ = ["grads", "metrics"]


def grads(ctx: GradContext, plan: ParamPlan, params: Any, batch: Any,
          scale: torch.Tensor | None) -> tuple[torch.Tensor, Any, torch.Tensor, Result]:
    """``(loss, grads, tokens, result)`` from the schedule; grads reduced and laid out like the optimizer state,
    ``result`` the run's :class:`~shardings.pipeline.Result` without its grads (timeline, saved activation peaks).

    Under a precision policy the stage weights are cast to compute dtype before they are gathered, the
    microbatches' gradients are summed in compute dtype by the executor (one per stage weight, in microbatch
    order) and cast to reduce dtype for their reduction; a loss scale multiplies every microbatch's weight.
    """
    pipe, own = ctx.pipeline, plan.ownership
    batch = batching.place(batch, ctx.layout, ctx.mesh, ctx.accum_steps)
    mbs = _chunks(pipe, batching.split(batch, ctx.accum_steps))
    total = ctx.token_count(batch)
    weights = [ctx.token_count(mb) / total for mb in mbs]
    if scale is not None:
        weights = [w * scale for w in weights]
    compute = tree.unflatten(plan.treedef, _gather_once(ctx, plan, params))
    carry = (ctx.loss_fn, _CarryPlacements(ctx.loss_fn, ctx.layout, ctx.mesh), ctx.mesh.device_mesh)
    # a constant a stage makes (a mask, arange) is replicated where it meets a DTensor
    with implicit_replication():
        result = run(pipe.schedule, _in_stage(ctx), pipe.split, compute, mbs, weights, mesh=ctx.full_mesh,
                     carry_layout=carry)
    g, opt_pl = tree.leaves(result.grads), plan.placements["opt_state"]
    held = own.held(len(g))
    # cast to reduce dtype bucket by bucket as each is reduced: never a copy of every gradient at once
    mine = dict(zip(held, buckets.reduce([g[i] for i in held], [opt_pl[i] for i in held], ctx.bucket_mb,
                                         ctx.cast.reduce)))
    # another stage's block: absent, stored like its optimizer state
    reduced = [mine[i] if i in mine else absent(x.shape, ctx.cast.to_reduce(x).dtype, ctx.mesh, opt_pl[i])
               for i, x in enumerate(g)]
    ownership.sum_shared(own, reduced)  # the first and the last stage each hold part (reduced in-stage first)
    loss = result.loss if scale is None else result.loss / scale
    # its timeline and peaks; the grads are reduced above
    return loss, tree.unflatten(plan.treedef, reduced), total, dataclasses.replace(result, grads=None)


def _chunks(pipe: Plan, mbs: list[Any]) -> list[Any]:
    """TeraPipe: each microbatch cut along its sequence (dim 1) into the plan's chunks, in order."""
    if pipe.seq_chunks == 1:
        return mbs
    return [c for mb in mbs for c in cut(mb, pipe.chunk_sizes(seq_length(mb)))]


def metrics(pipe: Plan, result: Result) -> dict[str, Any]:
    """``metrics["pipeline"]``: the schedule, its planned bubble (unit-time F and B), each rank's most bytes of
    activations saved for backward at once, and where ranks ran concurrently (real processes) ``bubble``: each
    rank's measured idle fraction."""
    out = {"schedule": pipe.schedule.name, "microbatches": pipe.microbatches, "seq_chunks": pipe.seq_chunks,
           "bubble_planned": pipe.schedule.bubble(), "saved_peak": list(result.saved_peak)}
    if result.measured:
        out["bubble"] = result.bubble()
    return out


def _gather_once(ctx: GradContext, plan: ParamPlan, params: Any) -> list[Any]:
    """This rank's parameters in their compute layout for the whole step: ZeRO-3's gathers (one all-gather
    per bucket, :func:`~shardings.residency.gather_buckets.gather`) run once before the schedule, not per
    microbatch (module docstring); another stage's block stays absent (real ranks)."""
    leaves, pl, cast = tree.leaves(params), plan.placements["compute"], ctx.cast
    held = plan.ownership.held(len(leaves))
    with torch.no_grad():
        gathered, gathers = gather_buckets.gather([leaves[i] for i in held], [pl[i] for i in held], ctx.bucket_mb,
                                                  [plan.units[i] for i in held], cast)
        gathered = [cast.to_compute(resolve(x)) for x in gathered]  # cast before a bucket's gather
        gathers.close()
    dtype = lambda x: cast.compute if cast.compute and x.is_floating_point() else x.dtype
    mine = dict(zip(held, gathered))
    return [mine[i] if i in mine else absent(x.shape, dtype(x), ctx.mesh, pl[i]) for i, x in enumerate(leaves)]


class _CarryPlacements(NamedTuple):
    """How a carry arriving from another process is laid out: the model's ``carry_names`` under the layout's
    activation rules, on the stage mesh. A value (equal from step to step): the executor caches its message
    layouts per carry layout."""

    stages: Stages
    layout: Layout
    mesh: Mesh

    def __call__(self, carry: Any) -> list[Any]:
        names = tree.leaves(self.stages.carry_names(carry), is_leaf=is_names)  # a tuple of tuples is a tree
        rules = self.layout.role("activations")
        return [lower.to_placements(logical_to_spec(n, rules, self.mesh), self.mesh, x.ndim)
                for n, x in zip(names, tree.leaves(carry))]


def _in_stage(ctx: GradContext) -> Stages:
    """The stage functions run with this layout's rules on the stage mesh (``constrain`` resolves there); the
    blocks compiled where the step compiles (``ctx.run_fn``); the carries' layout reads the eager ``ctx.loss_fn``."""
    stages = ctx.run_fn

    def scoped(f):
        def call(*args):
            with use(ctx.mesh, ctx.layout), dtensor_errors():
                return f(*args)
        return call

    prefix, first = (f and scoped(f) for f in (stages.prefix_block, stages.prefix_first))
    return Stages(scoped(stages.first), scoped(stages.block), scoped(stages.last), stages.blocks, prefix_block=prefix,
                  prefix_first=first)
