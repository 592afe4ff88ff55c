"""The update every gradient path shares: clipping, the optimizer on the leaves this process holds, the norm.

Whatever path made the gradients (local, DTensor or pipeline), they arrive reduced and laid out like the
optimizer state. :func:`update` clips them to the global norm, runs the optimizer in the ``opt_state`` layout
and puts the new parameters back in storage layout:

- an elementwise optimizer (``adamw``, ``sgd``, ...) updates each rank's local blocks
  (``local_step.update_blocks``: torch's fused kernel where it has one, in place when donated); on the local
  path ``local_step.apply`` also re-gathers ZeRO-1/2's updated shards in buckets;
- any other runs its pure update on the DTensors.

Under a policy whose compute dtype is narrower than the params' and a layout whose optimizer state is split where
the stored params are not (ZeRO-1/2), the optimizer state carries the fp32 master weights (``mixed.Master``): the
update runs on the master shard, and the stored params are its compute-dtype copy, gathered in compute dtype.

The :class:`~shardings.step.ownership.Ownership` of the step's plan says which leaves take part: all of them,
except for pipeline stages on real ranks, where a rank updates its own blocks and the parameters outside the
blocks (the other leaves, absent there, come back as they were), and where the global norm adds up each stage's
part (:func:`~shardings.step.ownership.global_norm`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

import core
from core import tree
from shardings.comm import flat_comm
from shardings.residency import offload
from shardings.spec.mesh import Mesh
from shardings.step import local_step, mixed, ownership
from shardings.step.context import ParamPlan, UpdateContext
from shardings.step.ownership import Ownership, is_absent

__all__ = ["apply", "grad_norm", "init", "merge", "select", "update", "weights"]


def _placed(leaves: Sequence[Any], placements: Sequence[Any]) -> list[Any]:
    return [x.redistribute(x.device_mesh, pl) for x, pl in zip(leaves, placements)]


def init(ctx: UpdateContext, plan: ParamPlan, params: Any) -> Any:
    """The optimizer state in the ``opt_state`` layout (``TrainStep.init``): ``mixed.Master(weights, opt)`` under
    ``plan.master``, on the host under offload, ``mixed.Scaled(loss_scale, ...)`` with a loss scaler."""
    with torch.no_grad():
        placed = _placed(tree.leaves(params), plan.placements["opt_state"])
        state = ctx.optimizer.init(tree.unflatten(plan.treedef, placed))
        if plan.master:  # copies: the params' storage is not kept alive by a view, nor written by a donation
            state = mixed.Master(tree.unflatten(plan.treedef, [x.clone() for x in placed]), state)
    if ctx.offload_opt:
        state = offload.to_host(state)
    return mixed.Scaled(ctx.scaler.init(), state) if ctx.scaler is not None else state


def apply(ctx: UpdateContext, plan: ParamPlan, params: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
    """:func:`update` after the loss scale's check (``TrainStep.apply``): with a scaler, a step whose gradients are
    not all finite on every rank is skipped (params and state unchanged, the scale halved)."""
    # a reduce dtype narrower than the params': clipping and the optimizer run in fp32 on the fp32 master
    # weights (one transient fp32 copy of the rank's gradients)
    master = weights(plan, params, opt_state.opt if ctx.scaler is not None else opt_state)
    grads = tree.map(lambda g, p: g.to(p.dtype) if g.dtype != p.dtype else g, grads, master)
    if ctx.scaler is None:
        return update(ctx, plan, params, opt_state, grads)
    ok = mixed.finite(ctx.mesh, tree.leaves(grads))
    scale = ctx.scaler.adjust(opt_state.loss_scale, ok)
    if not ok:
        return params, mixed.Scaled(scale, opt_state.opt)
    params, state = update(ctx, plan, params, opt_state.opt, grads)
    return params, mixed.Scaled(scale, state)


def grad_norm(mesh: Mesh, own: Ownership, grads: Any) -> torch.Tensor:
    """The global norm of reduced gradients, the ``grad_norm`` metric: local blocks and a few scalar all-reduces
    (``local_step.global_norm``), or each stage's part summed over ``pp`` where stages hold different leaves."""
    if not own.whole:
        return ownership.global_norm(own, tree.leaves(grads))
    norm = local_step.global_norm(mesh, tree.leaves(grads))
    return core.optim.global_norm(grads) if norm is None else norm


def _clipped(ctx: UpdateContext, own: Ownership, grads: Any, clip_state: Any) -> Any:
    """``grads`` scaled to the step's ``clip_norm`` by the global norm of every stage's gradients."""
    if own.whole:  # core's clip: the norm of the global (DTensor) gradients
        return ctx.clip.update(grads, clip_state)[0]
    factor = (ctx.clip_norm / (ownership.global_norm(own, tree.leaves(grads)) + 1e-6)).clamp(max=1.0)
    return tree.map(lambda g: g if is_absent(g) else g * factor.to(g.dtype), grads)


def update(ctx: UpdateContext, plan: ParamPlan, params: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
    """The optimizer's update (``TrainStep.apply`` without the loss scale's skip); grads in the dtype of
    :func:`weights` (the params', or the master weights' under ``plan.master``).

    Under ``plan.master`` (``mixed.Master``: ZeRO-1/2 with a policy) the update runs on the master weights in the
    ``opt_state`` layout and the new params are the updated master cast to compute dtype, then put back in storage
    layout (the all-gather moves compute-dtype bytes).

    Returns:
        ``(params, opt_state)``: params in storage layout.
    """
    master = plan.master
    weights_tree, opt_state = (opt_state.weights, opt_state.opt) if master else (params, opt_state)
    clip_state, state = (opt_state[0], opt_state[1]) if ctx.clip is not None else (None, opt_state)
    own, leaves = plan.ownership, tree.leaves(weights_tree)
    opt_pl, storage = plan.placements["opt_state"], plan.placements["params"]
    elementwise = getattr(ctx.inner, "elementwise", False)
    cast = ctx.cast if master else None
    after = opt_pl if master else storage  # where the updated weights go first
    new_weights = None
    with torch.no_grad():
        if ctx.clip is not None:
            grads = _clipped(ctx, own, grads, clip_state)
        g = tree.leaves(grads)
        if not own.whole:  # pipeline stages on real ranks: this rank's leaves only
            new, state = _update_held(ctx.inner, plan.treedef, leaves, g, state, own.held(len(leaves)), opt_pl,
                                      after, ctx.donate)
        elif not elementwise:
            p_opt = tree.unflatten(plan.treedef, _placed(leaves, opt_pl))
            updates, state = ctx.inner.update(grads, state, p_opt)
            new = _placed(tree.leaves(core.optim.apply_updates(p_opt, updates)), after)
        elif plan.local is not None:
            new, new_weights, state = local_step.apply(plan.local, ctx.mesh, ctx.inner, plan.treedef, leaves, state,
                                                       g, opt_pl, storage, donate=ctx.donate,
                                                       offload=ctx.offload_opt, master=cast)
        else:
            p_opt = _placed(leaves, opt_pl)
            blocks, state = local_step.update_blocks(ctx.inner, plan.treedef, [p.to_local() for p in p_opt], state,
                                                     g, ctx.donate, ctx.offload_opt, blocks_on_host=master)
            dm = ctx.mesh.device_mesh
            new = _placed([flat_comm.dtensor(x, dm, pl, p) for x, p, pl in zip(blocks, p_opt, opt_pl)], after)
        if master and new_weights is None:  # the compute copy of each updated master leaf, in storage layout
            new_weights, new = new, _stored(ctx, tree.leaves(params), new, storage)
    state = (clip_state, state) if ctx.clip is not None else state
    if master:
        state = mixed.Master(tree.unflatten(plan.treedef, new_weights), state)
    return tree.unflatten(plan.treedef, new), state


def weights(plan: ParamPlan, params: Any, opt_state: Any) -> Any:
    """The weights the optimizer updates: the master weights (in the ``opt_state`` layout) under ``plan.master``,
    else ``params``. ``opt_state`` without its loss scale (``mixed.Scaled.opt``)."""
    return opt_state.weights if plan.master else params


def _stored(ctx: UpdateContext, old: Sequence[Any], new_master: Sequence[Any], storage: Sequence[Any]) -> list[Any]:
    """Updated master leaves as stored params: cast to compute dtype on each rank's blocks, then placed in storage
    (the gather moves compute-dtype bytes); a leaf this rank does not hold (another stage's) stays as it was."""
    out = []
    for p, w, pl in zip(old, new_master, storage):
        if is_absent(w):
            out.append(p)
            continue
        w = ctx.cast.to_compute(w)
        if ctx.offload_opt:  # the master lives on the host with the state: its compute copy comes back
            w = offload.to_device(w, ctx.mesh.device_mesh.device_type)
        out.append(w.redistribute(w.device_mesh, pl))
    return out


def _shaped_like(treedef: Any) -> Callable[[Any], bool]:
    def check(x: Any) -> bool:
        return not isinstance(x, torch.Tensor) and tree.structure(x) == treedef
    return check


def select(state: Any, treedef: Any, held: Sequence[int]) -> Any:
    """``state`` (an optimizer state) with each params-shaped tree in it cut to the list of its ``held`` leaves."""
    like = _shaped_like(treedef)
    return tree.map(lambda x: [tree.leaves(x)[i] for i in held] if like(x) else x, state, is_leaf=like)


def merge(state: Any, sub: Any, treedef: Any, held: Sequence[int]) -> Any:
    """``state`` with the ``held`` leaves of each params-shaped tree replaced by ``sub``'s (:func:`select`'s)."""
    like = _shaped_like(treedef)

    def put(full: Any, part: Any) -> Any:
        if not like(full):
            return part
        leaves = tree.leaves(full)
        for i, x in zip(held, part):
            leaves[i] = x
        return tree.unflatten(treedef, leaves)

    return tree.map(put, state, sub, is_leaf=like)


def _update_held(optimizer: Any, treedef: Any, params: list[Any], grads: list[Any], state: Any, held: Sequence[int],
                 opt_placements: list[Any], param_placements: list[Any], donate: bool) -> tuple[list[Any], Any]:
    """One optimizer step on the ``held`` leaves (picked out of the params, the gradients and every params-shaped
    tree in the optimizer state, such as Adam's moments); the others come back as they were."""
    sub_def = tree.structure(list(held))
    sub_state = select(state, treedef, held)
    p_opt = [params[i].redistribute(params[i].device_mesh, opt_placements[i]) for i in held]
    g = [grads[i] for i in held]
    if getattr(optimizer, "elementwise", False):
        blocks, sub_state = local_step.update_blocks(optimizer, sub_def, [p.to_local() for p in p_opt], sub_state, g,
                                                     donate)
        new = [flat_comm.dtensor(x, p.device_mesh, opt_placements[i], p) for x, p, i in zip(blocks, p_opt, held)]
    else:
        updates, sub_state = optimizer.update(list(g), sub_state, list(p_opt))
        new = tree.leaves(core.optim.apply_updates(list(p_opt), updates))
    out = list(params)
    for i, x in zip(held, new):
        out[i] = x.redistribute(x.device_mesh, param_placements[i])
    return out, merge(state, sub_state, treedef, held)
