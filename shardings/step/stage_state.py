"""A pipeline rank's own parameters: other stages' blocks are placeholders, and the update skips them.

On real processes under ``pp`` a rank materializes only its own stage's blocks (``shardings.init``
makes the rest meta-device placeholders of the right shape and layout), so its optimizer state for
them is placeholders too. :func:`update` runs the optimizer on the rank's own leaves only: it picks
them out of the parameters, the gradients and every parameter-shaped tree inside the optimizer state
(Adam's moments), updates that list, and puts the results back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

import core
from core import tree
from shardings.comm import flat_comm
from shardings.step import local_step

__all__ = ["is_placeholder", "materialize", "update"]


def is_placeholder(x: Any) -> bool:
    """Whether ``x`` holds no data (a meta-device tensor or a DTensor whose local block is one)."""
    local = x.to_local() if isinstance(x, DTensor) else x
    return isinstance(local, torch.Tensor) and local.device.type == "meta"


def materialize(x: DTensor, device: torch.device) -> DTensor:
    """An uninitialized real tensor laid out like the placeholder ``x`` (to receive a broadcast into)."""
    local = torch.empty(x.to_local().shape, dtype=x.dtype, device=device)
    return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())


def _shaped_like(treedef: Any) -> Callable[[Any], bool]:
    def check(x: Any) -> bool:
        return not isinstance(x, torch.Tensor) and tree.structure(x) == treedef
    return check


def _select(state: Any, treedef: Any, own: Sequence[int]) -> Any:
    like = _shaped_like(treedef)
    return tree.map(lambda x: [tree.leaves(x)[i] for i in own] if like(x) else x, state, is_leaf=like)


def _merge(state: Any, sub: Any, treedef: Any, own: Sequence[int]) -> Any:
    like = _shaped_like(treedef)

    def put(full: Any, part: Any) -> Any:
        if not like(full):
            return part
        leaves = tree.leaves(full)
        for i, x in zip(own, part):
            leaves[i] = x
        return tree.unflatten(treedef, leaves)

    return tree.map(put, state, sub, is_leaf=like)


def update(optimizer: Any, treedef: Any, params: list[Any], grads: list[Any], state: Any, own: Sequence[int],
           opt_placements: list[Any], param_placements: list[Any], donate: bool = False) -> tuple[list[Any], Any]:
    """One optimizer step on the leaves ``own`` (indices into ``params``); the others come back as they were.

    ``params`` are in storage layout and come back so; the update runs in the optimizer-state layout
    (``opt_placements``), on local blocks for an elementwise optimizer (``local_step.update_blocks``).
    """
    sub_def = tree.structure(list(own))
    sub_state = _select(state, treedef, own)
    p_opt = [params[i].redistribute(params[i].device_mesh, opt_placements[i]) for i in own]
    g = [grads[i] for i in own]
    if getattr(optimizer, "elementwise", False):
        blocks, sub_state = local_step.update_blocks(optimizer, sub_def, [p.to_local() for p in p_opt], sub_state,
                                                     g, donate)
        new = [flat_comm.dtensor(x, p.device_mesh, opt_placements[i], p) for x, p, i in zip(blocks, p_opt, own)]
    else:
        updates, sub_state = optimizer.update(list(g), sub_state, list(p_opt))
        new = tree.leaves(core.optim.apply_updates(list(p_opt), updates))
    out = list(params)
    for i, x in zip(own, new):
        out[i] = x.redistribute(x.device_mesh, param_placements[i])
    return out, _merge(state, sub_state, treedef, own)
