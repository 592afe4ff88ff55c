"""How a state's tensors become what DCP writes, and what it reads becomes tensors in the target layout.

* Saving (:func:`split_state`): a state's leaves split into tensors (by key path) and JSON values. On
  simulated ranks every tensor is written whole (DTensors gathered; a plain tensor must agree across
  the ranks); on real ranks each rank writes its DTensor shards.
* Loading (:func:`empty_like`, :func:`place_like`): the buffers DCP fills, in the target's layout on real
  ranks (DCP reads each rank's shards from whichever saved shards overlap them) and whole on simulated
  ranks, then laid out like the target.
* ``pp`` on real processes (:func:`is_absent`): another stage's block on this rank is absent;
  it is neither written nor read.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from core import tree
from shardings.checkpoint.files import _error
from shardings.runtime.compat import LocalTensor, maybe_disable_local_tensor_mode
from shardings.runtime.simulate import simulated, simulated_world_size, unwrap
from shardings.step.ownership import is_absent

__all__ = ["empty_like", "is_absent", "place_like", "split_state"]


def _whole(path: str, x: torch.Tensor) -> torch.Tensor:
    """A simulated tensor as one plain tensor (DTensors gathered; ranks must agree on the rest)."""
    if isinstance(x, DTensor):
        x = x.full_tensor()
    try:
        return unwrap(x.detach())
    except ValueError as e:
        raise _error(
            f"the simulated ranks hold different values in this plain (non-DTensor) tensor ({e})",
            fix="keep rank-dependent values in DTensors, or save them per rank yourself",
            path=path,
        ) from None


def split_state(state: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``({path: tensor}, {path: JSON value})`` for the leaves of ``state``."""
    tensors, values = {}, {}
    for key_path, leaf in tree.leaves_with_path(state):
        path = tree.keystr(key_path)
        if isinstance(leaf, torch.Tensor):
            tensors[path] = _whole(path, leaf) if simulated() else leaf.detach()
            continue
        try:
            json.dumps(leaf, allow_nan=True)
        except TypeError:
            raise _error(
                f"a leaf of type {type(leaf).__name__} is neither a tensor nor a JSON value",
                fix="store configs as dicts of plain values (dataclasses.asdict(cfg)) and other state as tensors",
                path=path,
            ) from None
        values[path] = leaf
    return tensors, values


def empty_like(x: torch.Tensor) -> torch.Tensor:
    if isinstance(x, DTensor) and not simulated():
        return torch.empty_like(x)
    with maybe_disable_local_tensor_mode():
        return torch.empty(x.shape, dtype=x.dtype)


def place_like(loaded: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A whole tensor read in a simulated run, put back into ``like``'s layout."""
    n = simulated_world_size()
    if not n:
        return loaded
    local = LocalTensor({r: loaded for r in range(n)})
    if isinstance(like, DTensor):
        return distribute_tensor(local, like.device_mesh, like.placements, src_data_rank=None)
    return local
