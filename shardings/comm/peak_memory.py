"""The most bytes live tensors held at once during a block: ``torch.cuda.max_memory_allocated`` for any device.

CPU tensors have no allocator counter, and a process's RSS mixes tensors with code, Python
objects and what the C allocator keeps after a free. :func:`peak_memory` counts tensor storages
only:

- at entry, every storage reachable from a Python tensor object (a ``gc`` scan; subclasses such
  as DTensor count their inner tensors, views count their storage once);
- during the block, every storage an op returns (a ``TorchDispatchMode``, so autograd's backward
  ops count too), and ``UntypedStorage.resize_`` (FSDP2 frees and re-allocates gathered
  parameters that way);
- a storage stops counting when it is freed.

Not seen: buffers a collective backend or a C++ kernel allocates for itself (gloo's scratch space),
and storages at entry held only from C++ (none between train steps). Under ``simulate()`` one
process holds every rank's tensors, so the count is their sum (and LocalTensorMode's swaps of
per-rank RNG states show as frees).
"""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from shardings.runtime.compat import TorchDispatchMode, is_traceable_wrapper_subclass, pytree

__all__ = ["PeakMemory", "peak_memory", "storages"]


@dataclass
class PeakMemory:
    """Bytes of live tensor storage: at entry, now (``live``) and the most at once (``peak``)."""

    at_entry: int = 0
    live: int = 0
    peak: int = 0


def storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages holding ``t``'s data: its own, or its inner tensors' (DTensor, LocalTensor: one per rank)."""
    if is_traceable_wrapper_subclass(t):
        for name in t.__tensor_flatten__()[0]:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from storages(inner)
    elif t.device.type != "meta":
        yield t.untyped_storage()


# Collectives whose result is a buffer they were given (the input, or out=): a real tensor's result is that buffer,
# a fake tensor's a new one (the planner's steps): no new bytes either way
_F = torch.ops._c10d_functional
_RETURNS_INPUT = frozenset({_F.wait_tensor, _F.all_gather_into_tensor_out, _F.reduce_scatter_tensor_out})


class _Tracker(TorchDispatchMode):
    def __init__(self, out: PeakMemory):
        super().__init__()
        self.out = out
        self.sizes: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> [bytes] (a cell resize_ updates)

    def track(self, obj: object) -> None:
        for t in pytree.tree_leaves(obj):
            if isinstance(t, torch.Tensor):
                for st in storages(t):
                    if st not in self.sizes:
                        self._add(st)
        self.out.peak = max(self.out.peak, self.out.live)

    def _add(self, st: torch.UntypedStorage) -> list[int]:
        cell = self.sizes[st] = [st.nbytes()]
        self.out.live += cell[0]
        weakref.finalize(st, self._free, cell)
        return cell

    def _free(self, cell: list[int]) -> None:
        self.out.live -= cell[0]

    def resized(self, st: torch.UntypedStorage, before: int) -> None:
        cell = self.sizes.get(st)
        if cell is None:  # not seen before: counts from its new size
            cell, before = self._add(st), st.nbytes()
        self.out.live += st.nbytes() - before
        cell[0] = st.nbytes()
        self.out.peak = max(self.out.peak, self.out.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket not in _RETURNS_INPUT:
            self.track(out)
        return out


@contextlib.contextmanager
def peak_memory(roots: object = None) -> Iterator[PeakMemory]:
    """Count live tensor bytes in this process during the block; ``peak`` includes what was live at entry.

    Args:
        roots: a pytree whose tensors are what is live at entry, instead of every tensor in the process
            (a ``gc`` scan): for one step's bytes alone (the planner's steps on fake tensors).

    >>> with peak_memory() as m:  # doctest: +SKIP
    ...     params, state, metrics = step(params, state, batch)
    >>> m.peak / 2**20  # doctest: +SKIP
    61.1
    """
    out = PeakMemory()
    tracker = _Tracker(out)
    if roots is not None:
        tracker.track(roots)
    else:
        gc.collect()
        with warnings.catch_warnings():  # isinstance() on some module objects warns of their deprecation
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                if isinstance(obj, torch.Tensor):
                    tracker.track(obj)
    out.at_entry = out.live
    original = torch.UntypedStorage.resize_

    def resize_(st: torch.UntypedStorage, size: int):
        before = st.nbytes()
        result = original(st, size)
        tracker.resized(st, before)
        return result

    torch.UntypedStorage.resize_ = resize_
    try:
        with tracker:
            yield out
    finally:
        torch.UntypedStorage.resize_ = original
