"""Bytes of the activations a pipeline rank saves for backward: :class:`SavedActivations` counts each storage once,
parameters excluded, through autograd's saved-tensor hooks (what ``Result.saved_peak`` reports).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from shardings.comm.peak_memory import storages
from shardings.residency.gather_params import saved_tensors_hooks
from shardings.runtime.compat import pytree

__all__ = ["SavedActivations", "tensor_leaves"]


class SavedActivations:
    """Bytes of tensors saved for backward per rank (``live`` now, ``peak`` the most at once), each storage once.

    The storage of ``params`` (a pytree of tensors) is not counted: only activations. Count a rank's backward
    graph by building it under ``hooks(rank)``; what :attr:`Result.saved_peak` reports, usable around any
    autograd code (``experiments.bench.pipeline_torch`` counts torch's pipeline schedules with it).

    >>> w = torch.ones(4, 4, requires_grad=True)
    >>> saved = SavedActivations(1, [w])
    >>> with saved.hooks(0):
    ...     loss = (torch.ones(2, 4) @ w).sin().sum()  # saves the (2, 4) input of @ and of sin, not w
    >>> saved.peak[0]
    64
    """

    def __init__(self, ranks: int, params: Any = ()):
        self.live, self.peak = [0] * ranks, [0] * ranks
        self.refs: list[dict[int, int]] = [{} for _ in range(ranks)]
        self.param_ptrs = {_key(st) for x in tensor_leaves(params) for st in storages(x)}

    def hooks(self, rank: int) -> contextlib.AbstractContextManager[None]:
        def pack(t: torch.Tensor) -> Any:
            st = next(storages(t), None)  # one rank's piece (simulated ranks hold the same shapes)
            if st is None or _key(st) in self.param_ptrs:
                return t
            # t.detach(), not t: an output its own node saves (softmax's) would tie node and tensor in a cycle through
            # autograd's C++ graph, which gc cannot collect (every zero-bubble step's graph leaked: its B keeps it)
            return _Held(self, rank, st, t.detach())

        # seen beneath a ZeRO-3 Regather entered inside (a whole step's): gather_params.saved_tensors_hooks
        return saved_tensors_hooks(pack, lambda held: held.t if isinstance(held, _Held) else held)

    def add(self, rank: int, ptr: int, nbytes: int) -> None:
        refs = self.refs[rank]
        refs[ptr] = refs.get(ptr, 0) + 1
        if refs[ptr] == 1:
            self.live[rank] += nbytes
            self.peak[rank] = max(self.peak[rank], self.live[rank])

    def drop(self, rank: int, ptr: int, nbytes: int) -> None:
        refs = self.refs[rank]
        refs[ptr] -= 1
        if not refs[ptr]:
            del refs[ptr]
            self.live[rank] -= nbytes


def _key(st: torch.UntypedStorage) -> int:
    """A live storage's identity: its ``StorageImpl`` (not its data pointer, which is 0 for every fake tensor)."""
    return st._cdata


class _Held:
    def __init__(self, saved: SavedActivations, rank: int, st: torch.UntypedStorage, t: torch.Tensor):
        self.saved, self.rank, self.ptr, self.nbytes, self.t = saved, rank, _key(st), st.nbytes(), t
        saved.add(rank, self.ptr, self.nbytes)

    def __del__(self) -> None:
        self.saved.drop(self.rank, self.ptr, self.nbytes)


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]
