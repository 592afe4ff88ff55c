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
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["regather_in_backward", "register", "to_compute"]


class _Regather:
    """A saved tensor replaced by "gather again (``gather()``), then take the same view"."""

    __slots__ = ("gather", "local_geometry", "view_placements", "view_shape", "view_stride")

    def __init__(self, gather: Callable[[], DTensor], view: DTensor):
        self.gather = gather
        if hasattr(gather, "on_save"):
            gather.on_save()
        local = view._local_tensor
        self.local_geometry = (local.size(), local.stride(), local.storage_offset())
        self.view_placements, self.view_shape, self.view_stride = view.placements, view.shape, view.stride()

    def __call__(self) -> DTensor:
        with torch.no_grad():
            full = self.gather()
            local = full._local_tensor.as_strided(*self.local_geometry)
        return DTensor.from_local(
            local, full.device_mesh, self.view_placements, run_check=False,
            shape=self.view_shape, stride=self.view_stride,
        )


class _Registry:
    def __init__(self) -> None:
        self.gathered: dict[int, tuple[weakref.ref, Callable[[], DTensor]]] = {}

    def add(self, gathered: DTensor, gather: Callable[[], DTensor]) -> None:
        self.gathered[id(gathered)] = (weakref.ref(gathered), gather)

    def lookup(self, t: torch.Tensor) -> Callable[[], DTensor] | None:
        base = t._base if t._base is not None else t
        entry = self.gathered.get(id(base))
        if entry is None or entry[0]() is not base:
            return None
        return entry[1]


_ACTIVE: list[_Registry] = []


def to_compute(shard: DTensor, placements: Any) -> DTensor:
    """``shard`` redistributed to the compute placements, differentiably (backward: the grad reduction)."""
    if tuple(shard.placements) == tuple(placements):
        return shard
    gathered = shard.redistribute(shard.device_mesh, placements)
    register(gathered, functools.partial(_redistribute, shard.detach(), placements))
    return gathered


def register(gathered: DTensor, gather: Callable[[], DTensor]) -> None:
    """Inside :func:`regather_in_backward`, autograd saves ``gathered`` (or a view of it) as a call to
    ``gather()``, which must return an equal tensor laid out the same way (a fresh gather does).
    A ``gather`` with an ``on_save()`` method has it called each time such a save happens."""
    if _ACTIVE:
        _ACTIVE[-1].add(gathered, gather)


def _redistribute(shard: DTensor, placements: Any) -> DTensor:
    return shard.redistribute(shard.device_mesh, placements)


def _pack(t: torch.Tensor) -> Any:
    gather = _ACTIVE[-1].lookup(t) if _ACTIVE and isinstance(t, DTensor) else None
    return _Regather(gather, t) if gather else t


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
