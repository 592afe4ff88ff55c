"""Placeholders for gathered parameters, materialized on first use: FSDP's per-block forward gathers.

ZeRO-3 hands the loss a tree of full parameters, but the loss uses one block's at a time. A
:class:`Lazy` placeholder has the full parameter's shape and dtype and no storage; the first torch
operation that touches it asks its owner (:class:`Gathers`) for the real tensor: wait for the
bucket's all-gather, assemble it, launch the next bucket's, and the op runs on that. The owner
keeps only the buckets in use, so a block's gathered weights are freed once the loss moves
on to the next block (autograd saves them as re-gather handles, never the weights themselves),
as FSDP2's post-forward reshard. Metadata (``shape``, ``dtype``, ``ndim``, ...) is answered by the
placeholder itself, and so is a cast (``x.to(dtype)``, a precision policy's cast to its compute dtype): another
placeholder, cast when it is gathered. Code that branches on a tensor's type before operating on it calls
:func:`resolve` first (``shardings.einsum``, ``constrain``, ``shard_map``, the vocab-parallel embedding do).

Under remat (activation checkpointing, ``core.remat``) a block's checkpoint keeps its inputs until backward: the
placeholders, not the gathered weights. Backward's recomputation of the block uses them again, so the owner
gathers the bucket once more, and that gathered copy is what the block's backward then uses (its recomputed
saved tensors): one gather per block in forward, one in backward, as FSDP with activation checkpointing. After
forward (:meth:`Gathers.close`) the owner prefetches in backward's order: the bucket the recomputation of the block
before needs, unless autograd saved that bucket as re-gather handles
(:class:`~shardings.residency.gather_params.Regather`, which gathers it then).

A ``torch.autograd.Function``'s ``apply()`` does not go through torch functions, so it takes a placeholder as it is:
its output hangs off the placeholder, not the gathered weight, and the weight's gradient would be lost without a
word. :meth:`Gathers.grad` (the step's backward) asks autograd for the placeholders' gradients too and raises,
naming the leaf, when one got any; the fix is :func:`resolve` before ``apply()``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from core import tree
from shardings.comm import flat_comm as fc
from shardings.residency import gather_params
from shardings.runtime.compat import disable_torch_function_subclass, pytree
from shardings.spec.errors import sharding_error
from shardings.spec.placeholder import Placeholder, resolve

__all__ = ["Gathers", "Lazy", "resolve"]

# answered by the placeholder: its shape, dtype and device are the full parameter's (a view such as
# ``.T``, or anything reading data, materializes it)
_METADATA = {
    *(getattr(torch.Tensor, name).__get__ for name in (
        "shape", "dtype", "ndim", "device", "layout", "requires_grad", "is_leaf", "is_cuda", "is_meta", "itemsize",
        "nbytes")),
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.element_size,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.get_device,
}


class Gathers:
    """One forward's gathered buckets behind placeholders (ZeRO-3's, on the local and DTensor paths).

    ``launch(k)`` starts bucket ``k``'s all-gather; ``build(k, flat)`` turns the gathered buffer into
    the bucket's full tensors (through the autograd function whose backward reduce-scatters). The
    first two buckets are launched up front; materializing bucket ``k`` launches ``k + 1`` and drops
    every earlier bucket not in ``kept`` (a block's weights, once the loss moves on: FSDP2's reshard
    after forward; used again later, a bucket is gathered again: correct, one more collective).
    """

    def __init__(self, count: int, kept: Sequence[int], launch: Callable[[int], torch.Tensor],
                 build: Callable[[int, torch.Tensor], Sequence[torch.Tensor]]):
        self.count, self.kept, self.launch, self.build = count, tuple(kept), launch, build
        self.pending = {k: launch(k) for k in range(min(2, count))}  # bucket -> all-gather in flight
        self.live: dict[int, Sequence[torch.Tensor]] = {}  # bucket -> its full tensors, while forward uses them
        self.in_backward = False  # forward is over (close): a materialization now is a recomputation (remat)
        self.handles: dict[int, Callable[[], bool]] = {}  # bucket -> whether autograd saved it as re-gather handles
        self.made: list[Lazy] = []  # every placeholder handed out, casts included: :meth:`grad` checks them
        self.leaf_of: dict[tuple[int, int], int] = {}  # (bucket, position) -> leaf index

    def placeholders(self, buckets: Sequence[Sequence[int]], like: Sequence[torch.Tensor],
                     shape_of: Callable[[int], torch.Size]) -> dict[int, torch.Tensor]:
        """Leaf index -> a :class:`Lazy` of its bucket, with ``like[i]``'s dtype and the full shape
        ``shape_of(i)`` (the real tensors when compiling: no subclass to trace)."""
        if torch.compiler.is_compiling():
            return {i: self.materialize(k)[pos] for k, b in enumerate(buckets) for pos, i in enumerate(b)}
        self.leaf_of.update({(k, pos): i for k, b in enumerate(buckets) for pos, i in enumerate(b)})
        return {i: Lazy(like[i], shape_of(i), self, k, pos) for k, b in enumerate(buckets) for pos, i in enumerate(b)}

    def grad(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], treedef: Any) -> tuple:
        """``torch.autograd.grad(output, inputs, allow_unused=True)``, and a :class:`ShardingError` when a gradient
        reached a placeholder itself (an op that bypassed torch functions took it ungathered: the gradient would be
        lost). ``treedef``: the parameters' structure, whose leaves ``inputs`` are (the error names the key path)."""
        stray = [p for p in self.made if p.requires_grad]
        with disable_torch_function_subclass():  # the placeholders go to autograd as they are, ungathered
            got = torch.autograd.grad(output, [*inputs, *stray], allow_unused=True)
        lost = [p for p, g in zip(stray, got[len(inputs):]) if g is not None]
        if lost:
            paths = [path for path, _ in tree.leaves_with_path(tree.unflatten(treedef, range(len(inputs))))]
            raise sharding_error(
                "a gradient reached the ZeRO-3 placeholder of this parameter, not its gathered weight: an op that "
                "bypasses torch functions (a torch.autograd.Function's apply()) took it ungathered, and the "
                "parameter's gradient would be lost", path=paths[self.leaf_of[lost[0].bucket, lost[0].pos]],
                shape=lost[0].shape,
                fix="pass shardings.resolve(w) (the gathered weight; w itself without ZeRO-3) to the Function")
        return got[:len(inputs)]

    @torch.compiler.disable  # a collective and Python bookkeeping: never traced into a graph (jit=True)
    def materialize(self, k: int) -> Sequence[torch.Tensor]:
        got = self.live.get(k)
        if got is not None:
            return got
        flat = self.pending.pop(k) if k in self.pending else self.launch(k)
        self._drop_blocks()  # the previous block's weights go before this one's are assembled next to its buffer
        with torch.enable_grad():  # an op under no_grad may touch it first; later ones need the gradient
            fulls = self.build(k, flat)
        del flat  # assembled: the gathered buffer goes before the next one is launched (one bucket at a time)
        self.live[k] = fulls
        regather = gather_params.active()
        if not self.in_backward and regather is not None and fulls:
            self.handles.setdefault(k, functools.partial(regather.saved, regather.bucket_of(fulls[0])))
        nxt = self._next(k)
        if nxt is not None:
            self.pending[nxt] = self.launch(nxt)  # prefetch: it gathers while this bucket computes
        return fulls

    def _next(self, k: int) -> int | None:
        """The bucket to prefetch once ``k`` is in use: in forward ``k + 1``; in backward (a recomputation under
        remat) ``k - 1``, which the recomputation of the block before needs next, unless it stays gathered
        (``kept``) or autograd saved it as re-gather handles (``Regather`` gathers it)."""
        nxt = k - 1 if self.in_backward else k + 1
        if not 0 <= nxt < self.count or nxt in self.pending or nxt in self.live:
            return None
        if self.in_backward and (nxt in self.kept or nxt not in self.handles or self.handles[nxt]()):
            return None
        return nxt

    def _drop_blocks(self) -> None:
        """Forget the buckets not in ``kept`` (freed unless an op or autograd still holds them)."""
        for k in [k for k in self.live if k not in self.kept]:
            del self.live[k]

    def close(self) -> None:
        """At the end of forward: forget every bucket (autograd holds what backward needs) and await a
        prefetch the loss never used (an unused block). Again after backward, where a recomputed block
        (remat) gathered once more."""
        self.in_backward = True
        self.live.clear()  # the kept ones' (a reference cycle through their autograd nodes otherwise)
        for flat in self.pending.values():
            fc.wait(flat)
        self.pending.clear()


class Lazy(Placeholder):
    """Leaf ``pos`` of ``bucket``, gathered by ``owner`` when an operation first needs it."""

    owner: Gathers
    bucket: int
    pos: int

    @staticmethod
    def __new__(cls, like: torch.Tensor, shape: torch.Size, owner: Gathers, bucket: int, pos: int,
                dtype: torch.dtype | None = None) -> Lazy:
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype or like.dtype, device=like.device,
                                                   requires_grad=like.requires_grad)
        self.owner, self.bucket, self.pos = owner, bucket, pos
        owner.made.append(self)
        return self

    def materialize(self) -> torch.Tensor:
        full = self.owner.materialize(self.bucket)[self.pos]
        return full.to(self.dtype)  # itself when gathered in this dtype (a policy's gathers cast before they move)

    def __repr__(self) -> str:  # no data to print
        return f"Lazy(shape={tuple(self.shape)}, dtype={self.dtype}, bucket={self.bucket})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with disable_torch_function_subclass():
                return func(*args, **kwargs)
        dtype = _cast_to(func, args, kwargs)
        if dtype is not None:  # a cast stays a placeholder: resolving it here would gather every bucket at once
            x = args[0]
            return x if dtype == x.dtype else Lazy(x, x.shape, x.owner, x.bucket, x.pos, dtype)
        args, kwargs = pytree.tree_map_only(Lazy, resolve, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        raise RuntimeError(f"{func} reached a Lazy parameter placeholder below torch functions; it has no data")


def _cast_to(func: Any, args: tuple, kwargs: dict) -> torch.dtype | None:
    """The dtype of ``x.to(dtype)`` (nothing else: no device, no copy) on a placeholder ``x``, else ``None``."""
    if func is not torch.Tensor.to or not isinstance(args[0], Lazy):
        return None
    rest = (*args[1:], *kwargs.values())
    if len(rest) != 1 or not isinstance(rest[0], torch.dtype) or set(kwargs) - {"dtype"}:
        return None
    return rest[0]
