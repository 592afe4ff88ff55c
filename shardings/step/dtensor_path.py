"""The DTensor path: the loss on DTensors, for layouts that also split model axes (``tp``, ``sp``, ``cp``, ``ep``).

Per microbatch, parameters go from storage to compute placements (ZeRO-3: bucketed all-gathers, re-gathered
in backward rather than kept, :mod:`shardings.residency.gather_buckets`), ``loss_fn`` runs under
``use(mesh, layout)`` so its ``constrain`` calls resolve, and ``torch.autograd.grad`` gives gradients that
come out ``Partial`` over the data axes. A sharded ``grads`` role means "never hold full gradients": each is
reduced as backward produces it (:func:`reduce_in_backward`). Otherwise gradients stay ``Partial`` across
microbatches and are reduced once, straight into the ``opt_state`` placements: an all-reduce per bucket
where those are replicated, a reduce-scatter where they are sharded (:func:`shardings.comm.buckets.reduce`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from core import tree
from shardings.comm import buckets
from shardings.ops.module_tp import dtensor_errors
from shardings.residency import gather_buckets
from shardings.residency.gather_params import regather_in_backward
from shardings.runtime.compat import implicit_replication
from shardings.spec.context import use
from shardings.step import batching
from shardings.step.context import GradContext, ParamPlan
from shardings.step.mixed import Cast

__all__ = ["grads", "reduce_in_backward"]


def reduce_in_backward(placements: dict[str, list]) -> list[bool]:
    """Per leaf, whether its gradient is reduced as backward produces it (a sharded grads role: ZeRO-2/3 memory).

    A gradient whose compute placement differs from storage is reduced by the gather's backward instead.
    """
    return [g != c and c == s for g, c, s in zip(placements["grads"], placements["compute"], placements["params"])]


def _reducer(placements: Any, cast: Cast) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda g: cast.to_reduce(g).redistribute(g.device_mesh, placements).to(g.dtype)


def grads(ctx: GradContext, plan: ParamPlan, params: Any, batch: Any,
          scale: torch.Tensor | None) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """``(loss, grads, tokens)`` of the global mean loss on a placed ``batch``; grads reduced into the optimizer
    state's placements. ``scale``: backward runs on the loss times it."""
    leaves = [p.detach().requires_grad_(True) for p in tree.leaves(params)]
    reduce_now = reduce_in_backward(plan.placements)
    hooks = [p.register_hook(_reducer(plan.placements["grads"][i], ctx.cast))
             for i, p in enumerate(leaves) if reduce_now[i]]
    total_tokens = ctx.token_count(batch)
    loss_sum, acc = None, None
    try:
        for mb in batching.split(batch, ctx.accum_steps):
            weight = ctx.token_count(mb) / total_tokens
            # a constant the loss makes (a mask, arange) is replicated where it meets a DTensor, in forward and backward
            with use(ctx.mesh, ctx.layout), implicit_replication(), regather_in_backward(), dtensor_errors():
                compute, gathers = gather_buckets.gather(leaves, plan.placements["compute"], ctx.bucket_mb,
                                                         plan.units, ctx.cast)
                compute = [ctx.cast.to_compute(x) for x in compute]
                loss = ctx.run_fn(tree.unflatten(plan.treedef, compute), mb) * weight
                del compute
                gathers.close()  # forget every gathered bucket: autograd holds what backward needs
                scaled = loss if scale is None else loss * scale
                g = gather_buckets.settle(gathers.grad(scaled, leaves, plan.treedef), gathers)
            g = [ctx.cast.to_reduce(torch.zeros_like(p) if gi is None else gi) for p, gi in zip(leaves, g)]
            acc = g if acc is None else [a + b for a, b in zip(acc, g)]
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    finally:
        for h in hooks:
            h.remove()
    # Partial -> replicated: all-reduce (one per bucket); -> sharded: reduce-scatter (per leaf).
    reduced = buckets.reduce(acc, plan.placements["opt_state"], ctx.bucket_mb)
    return loss_sum, tree.unflatten(plan.treedef, reduced), total_tokens
