"""Parameters gathered for compute, re-gathered in backward instead of kept alive (ZeRO-3).

When a layout stores a parameter sharded but computes with it gathered, the gather is a
``redistribute`` inside autograd: its backward is the reduce-scatter of the gradient. Left alone,
autograd would keep every gathered weight saved for backward, so each rank would hold the full
parameters until backward ends — DP's memory. Instead, while the loss runs, any tensor autograd
saves that *is* (or is a view of) a gathered parameter is stored as a handle to its shard, and
unpacked in backward by gathering again: all-gather forward, all-gather backward, reduce-scatter.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["regather_in_backward", "register", "to_compute"]


class _Regather:
    """A saved tensor replaced by "gather ``shard`` again, then take the same view"."""

    __slots__ = ("local_geometry", "placements", "shard", "view_placements", "view_shape", "view_stride")

    def __init__(self, shard: DTensor, placements: Any, view: DTensor):
        self.shard, self.placements = shard, placements
        local = view._local_tensor
        self.local_geometry = (local.size(), local.stride(), local.storage_offset())
        self.view_placements, self.view_shape, self.view_stride = view.placements, view.shape, view.stride()

    def __call__(self) -> DTensor:
        with torch.no_grad():
            full = self.shard.redistribute(self.shard.device_mesh, self.placements)
            local = full._local_tensor.as_strided(*self.local_geometry)
        return DTensor.from_local(
            local, self.shard.device_mesh, self.view_placements, run_check=False,
            shape=self.view_shape, stride=self.view_stride,
        )


class _Registry:
    def __init__(self) -> None:
        self.gathered: dict[int, tuple[weakref.ref, DTensor, Any]] = {}

    def add(self, gathered: DTensor, shard: DTensor, placements: Any) -> None:
        self.gathered[id(gathered)] = (weakref.ref(gathered), shard, placements)

    def lookup(self, t: torch.Tensor) -> tuple[DTensor, Any] | None:
        base = t._base if t._base is not None else t
        entry = self.gathered.get(id(base))
        if entry is None or entry[0]() is not base:
            return None
        return entry[1], entry[2]


_ACTIVE: list[_Registry] = []


def to_compute(shard: DTensor, placements: Any) -> DTensor:
    """``shard`` redistributed to the compute placements, differentiably (backward: the grad reduction)."""
    if tuple(shard.placements) == tuple(placements):
        return shard
    gathered = shard.redistribute(shard.device_mesh, placements)
    register(gathered, shard.detach(), placements)
    return gathered


def register(gathered: DTensor, shard: DTensor, placements: Any) -> None:
    """Inside :func:`regather_in_backward`, autograd saves ``gathered`` as "gather ``shard`` to ``placements``
    again" (``gathered`` must own its storage from offset 0, as a fresh gather does)."""
    if _ACTIVE:
        _ACTIVE[-1].add(gathered, shard, placements)


def _pack(t: torch.Tensor) -> Any:
    hit = _ACTIVE[-1].lookup(t) if _ACTIVE and isinstance(t, DTensor) else None
    return _Regather(hit[0], hit[1], t) if hit else t


def _unpack(saved: Any) -> torch.Tensor:
    return saved() if isinstance(saved, _Regather) else saved


@contextlib.contextmanager
def regather_in_backward() -> Iterator[None]:
    """Within this context, gathered parameters saved by autograd are re-gathered in backward."""
    _ACTIVE.append(_Registry())
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _ACTIVE.pop()
