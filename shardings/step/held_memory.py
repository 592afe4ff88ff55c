"""Bytes a train step holds per rank beyond what its state trees say (``metrics["memory"]``): the gradients
while they are reduced, and the compute-dtype copies of the params a precision policy makes."""

from __future__ import annotations

import math
from typing import Any

import torch

from core import tree
from shardings.comm import accounting
from shardings.spec.mesh import Mesh, P
from shardings.step import dtensor_path, ownership
from shardings.step.context import ParamPlan

__all__ = ["HELD_ROLES", "compute_copy_bytes", "grad_bytes", "roles"]

HELD_ROLES = ("params", "compute", "grads", "opt_state")
"""The roles of ``metrics["memory"]`` (besides ``host``): what a step holds between steps, per rank. The planner's
memory model (``shardings.planner.memory``) counts the same roles, and what a step adds at its peak."""


def grad_bytes(plan: ParamPlan, mesh: Mesh, params: Any, grads: Any) -> int:
    """Gradients held per rank: reduced in backward (a sharded grads role) they take the grads layout; otherwise
    backward leaves them whole-per-rank in the compute layout until reduced. Static for a plan (shapes, specs and
    dtypes do not change between steps): the step computes it once."""
    specs = {r: tree.leaves(plan.specs[r], is_leaf=lambda s: isinstance(s, P)) for r in ("grads", "compute")}
    reduce_now, total = dtensor_path.reduce_in_backward(plan.placements), 0
    for i, (p, g) in enumerate(zip(tree.leaves(params), tree.leaves(grads))):
        gathered = plan.placements["compute"][i] != plan.placements["params"][i]
        spec = specs["grads" if reduce_now[i] or gathered else "compute"][i]
        dims = spec.dim_axes() + ((),) * p.ndim
        total += math.prod(-(-n // mesh.axis_size(a)) for n, a in zip(p.shape, dims)) * g.element_size()
    return total


def compute_copy_bytes(dtype: torch.dtype | None, params: Any) -> int:
    """Bytes of the ``dtype`` copies of the params each rank makes (its stored blocks, cast before any gather):
    0 without a policy (``None``) or when ``dtype`` is the params' own."""
    if dtype is None:
        return 0
    held = [p for p in tree.leaves(params) if p.is_floating_point() and p.dtype != dtype]
    return accounting.memory(held) * dtype.itemsize // max(1, held[0].dtype.itemsize) if held else 0


def roles(params: Any, opt_state: Any, grad_nbytes: int, compute: torch.dtype | None, host: Any) -> dict[str, int]:
    """``metrics["memory"]``: bytes per rank by role after a step — the params and optimizer state this rank holds
    (another stage's absent blocks not counted), their compute-dtype copies, the gradients (:func:`grad_bytes`),
    and ``host``: those of the roles in ``host`` (the layout's offloaded roles) that live in host memory."""
    held = lambda t: accounting.memory([x for x in tree.leaves(t) if not ownership.is_absent(x)])
    out = dict(zip(HELD_ROLES, (held(params), compute_copy_bytes(compute, params), grad_nbytes, held(opt_state))))
    return out | {"host": sum(accounting.memory(t) for r, t in (("params", params), ("opt_state", opt_state))
                              if r in host)}
