"""Parameters gathered for compute, re-gathered in backward instead of kept alive (ZeRO-3): one mechanism
for both execution paths.

When a layout stores a parameter sharded but computes with it gathered, autograd would keep every
gathered weight saved for backward, so each rank would hold the full parameters until backward ends
— DP's memory. Instead, while the loss runs, any tensor autograd saves that *is* (or is a view of) a
gathered parameter, or of a gathered DTensor's local block (what ``shard_map`` hands its function: the
experts of ``zero3+ep``), is stored as a handle: (its bucket, its place in the bucket, the view's geometry).
In backward the handle gathers the whole bucket again (one collective), takes the same view, and
launches the gather of the bucket backward reaches next — the reverse of the order autograd first
saved the buckets in, which is the order backward visits them. The re-gathered bucket is held until
its own backward (the reduce-scatter) has run, then released.

A bucket is registered with :meth:`Regather.add`: its gathered tensors, ``launch()`` (start the
all-gather; any handle) and ``assemble(handle)`` (the bucket's tensors again, laid out as the first
time). The local path (:mod:`shardings.step.local_step`) registers plain tensors, the DTensor path
(:mod:`shardings.residency.gather_buckets`, and :func:`to_compute` one parameter at a time) DTensors.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["Regather", "regather_in_backward", "saved_tensors_hooks", "to_compute"]


class _Bucket:
    __slots__ = ("assemble", "cached", "done", "hold", "launch", "pending")

    def __init__(self, launch: Callable[[], Any], assemble: Callable[[Any], Sequence[torch.Tensor]], hold: bool):
        self.launch, self.assemble, self.hold = launch, assemble, hold
        self.pending: Any = None  # a launched re-gather (prefetched)
        self.cached: Sequence[torch.Tensor] | None = None  # the re-gathered tensors, until the bucket's backward
        self.done = False  # its backward has run


class _Handle:
    """What autograd holds instead of a gathered parameter (or a view of one, or of its local block)."""

    __slots__ = ("bucket", "geometry", "local", "pos", "view")

    def __init__(self, bucket: int, pos: int, t: torch.Tensor, local: bool = False):
        self.bucket, self.pos, self.local = bucket, pos, local
        block = t._local_tensor if isinstance(t, DTensor) else t
        self.geometry = (block.size(), block.stride(), block.storage_offset())
        self.view = (t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None

    def rebuild(self, full: torch.Tensor) -> torch.Tensor:
        if self.local:  # this rank's block of a gathered DTensor (what shard_map hands its function)
            return full._local_tensor.as_strided(*self.geometry)
        if self.view is None:
            return full.as_strided(*self.geometry)
        local = full._local_tensor.as_strided(*self.geometry)
        placements, shape, stride = self.view
        return DTensor.from_local(local, full.device_mesh, placements, run_check=False, shape=shape, stride=stride)


class _Passed:
    """A tensor a :class:`Regather` saves as it is, packed by the hooks it was entered under
    (:func:`saved_tensors_hooks`)."""

    __slots__ = ("packed", "unpack")

    def __init__(self, packed: Any, unpack: Callable[[Any], torch.Tensor]):
        self.packed, self.unpack = packed, unpack


class Regather:
    """One step's gathered buckets, saved by autograd as re-gather handles (module docstring)."""

    def __init__(self) -> None:
        self.outer: tuple[Callable, Callable] | None = None  # the saved_tensors_hooks entered around saving()
        self.buckets: list[_Bucket] = []
        # id(gathered tensor) -> (ref, bucket, pos, whether it is a gathered DTensor's local block)
        self.tensors: dict[int, tuple[weakref.ref, int, int, bool]] = {}
        self.order: list[int] = []  # buckets in reverse first-save order: backward's order

    def add(self, fulls: Sequence[torch.Tensor], launch: Callable[[], Any],
            assemble: Callable[[Any], Sequence[torch.Tensor]], *, hold: bool = True) -> int:
        """Register a gathered bucket; returns its id, for :meth:`release`. ``hold=False``: a bucket with no
        backward of its own to release it (:func:`to_compute`'s) is gathered again at every unpack, never held."""
        k = len(self.buckets)
        self.buckets.append(_Bucket(launch, assemble, hold))
        for pos, f in enumerate(fulls):
            base = f._base if f._base is not None else f  # a one-leaf bucket's may be a view of the gathered buffer
            for t in {id(f): f, id(base): base}.values():
                self.tensors[id(t)] = (weakref.ref(t), k, pos, False)
            block = f._local_tensor if isinstance(f, DTensor) else None
            if block is not None and block._base is None:  # shard_map's functions save views of it (experts)
                self.tensors[id(block)] = (weakref.ref(block), k, pos, True)
        return k

    def bucket_of(self, t: torch.Tensor) -> int | None:
        """The bucket ``t`` (a gathered tensor given to :meth:`add`) is registered in, or ``None``."""
        hit = self.tensors.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def saved(self, k: int | None) -> bool:
        """Whether autograd saved bucket ``k`` as re-gather handles (so far): backward gathers it here."""
        return k in self.order

    def release(self, k: int) -> None:
        """Bucket ``k``'s backward has run: drop its re-gathered tensors, prefetch nothing for it again."""
        bucket = self.buckets[k]
        bucket.cached, bucket.pending, bucket.done = None, None, True

    @torch.compiler.disable  # autograd calls it from compiled code too (jit=True): bookkeeping, not compute
    def pack(self, t: torch.Tensor) -> Any:
        base = t._base if t._base is not None else t
        hit = self.tensors.get(id(base))
        if hit is None or hit[0]() is not base:
            return t if self.outer is None else _Passed(self.outer[0](t), self.outer[1])
        if hit[1] not in self.order:
            self.order.insert(0, hit[1])
        return _Handle(hit[1], hit[2], t, local=hit[3])

    @torch.compiler.disable
    def unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, _Passed):
            return saved.unpack(saved.packed)
        return saved.rebuild(self.gathered(saved.bucket)[saved.pos]) if isinstance(saved, _Handle) else saved

    @torch.compiler.disable
    def gathered(self, k: int) -> Sequence[torch.Tensor]:
        """Bucket ``k`` gathered again (the first time backward asks), launching the next one's gather."""
        bucket = self.buckets[k]
        if not bucket.hold:
            with torch.no_grad():
                return bucket.assemble(bucket.launch())
        if bucket.cached is None:
            with torch.no_grad():  # the gather's backward is the bucket's own reduce-scatter, not autograd's
                handle = bucket.pending if bucket.pending is not None else bucket.launch()
                bucket.cached, bucket.pending = bucket.assemble(handle), None
            at = self.order.index(k) if k in self.order else len(self.order)
            if at + 1 < len(self.order):
                nxt = self.buckets[self.order[at + 1]]
                if not nxt.done and nxt.cached is None and nxt.pending is None:
                    with torch.no_grad():
                        nxt.pending = nxt.launch()
        return bucket.cached

    @contextlib.contextmanager
    def saving(self) -> Iterator[Regather]:
        """Within this context, autograd saves this object's gathered tensors as re-gather handles."""
        _ACTIVE.append(self)
        self.outer = _OUTER[-1] if _OUTER else None
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield self
        finally:
            _ACTIVE.pop()


_ACTIVE: list[Regather] = []
_OUTER: list[tuple[Callable, Callable]] = []  # the saved_tensors_hooks entered, innermost last


@contextlib.contextmanager
def saved_tensors_hooks(pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor]) -> Iterator[None]:
    """``torch.autograd.graph.saved_tensors_hooks(pack, unpack)`` that also sees, beneath a :class:`Regather` entered
    inside it, every tensor the Regather saves as it is (the activations; its gathered parameters stay handles).
    Autograd applies only the innermost hooks: without this, a step's own Regather (every local and DTensor step has
    one) hides its saved activations from hooks around the step (``shardings.pipeline.SavedActivations``)."""
    _OUTER.append((pack, unpack))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        _OUTER.pop()


def active() -> Regather | None:
    """The :class:`Regather` of the innermost :func:`regather_in_backward` (or local step), if any."""
    return _ACTIVE[-1] if _ACTIVE else None


def regather_in_backward() -> contextlib.AbstractContextManager[Regather]:
    """Within this context, gathered parameters saved by autograd are re-gathered in backward."""
    return Regather().saving()


def to_compute(shard: DTensor, placements: Any) -> DTensor:
    """``shard`` redistributed to the compute placements, differentiably (backward: the grad reduction);
    inside :func:`regather_in_backward`, re-gathered in backward rather than kept (a bucket of one)."""
    if tuple(shard.placements) == tuple(placements):
        return shard
    gathered = shard.redistribute(shard.device_mesh, placements)
    regather = active()
    if regather is not None:
        again = functools.partial(_redistribute, shard.detach(), placements)
        regather.add([gathered], launch=lambda: None, assemble=lambda _: [again()], hold=False)
    return gathered


def _redistribute(shard: DTensor, placements: Any) -> DTensor:
    return shard.redistribute(shard.device_mesh, placements)
