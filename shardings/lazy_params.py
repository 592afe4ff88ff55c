"""Placeholders for gathered parameters, materialized on first use: FSDP's per-block forward gathers.

ZeRO-3 hands the loss a tree of full parameters, but the loss uses one block's at a time. A
:class:`Lazy` placeholder has the full parameter's shape and dtype and no storage; the first torch
operation that touches it asks its owner for the real tensor (``owner.materialize(bucket)``: wait
for the bucket's all-gather, assemble it, launch the next bucket's), and the op runs on that. The
owner keeps only the buckets in use, so a block's gathered weights are freed once the loss moves
on to the next block (autograd saves them as re-gather handles, never the weights themselves),
as FSDP2's post-forward reshard. Metadata (``shape``, ``dtype``, ``ndim``, ...) is answered by the
placeholder itself. Code that branches on a tensor's type before operating on it calls
:func:`resolve` first (``shardings.einsum``, ``constrain``, ``shard_map``, the vocab-parallel embedding do).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_map_only

__all__ = ["Lazy", "resolve"]

# answered by the placeholder: its shape, dtype and device are the full parameter's (a view such as
# ``.T``, or anything reading data, materializes it)
_METADATA = {
    *(getattr(torch.Tensor, name).__get__ for name in (
        "shape", "dtype", "ndim", "device", "layout", "requires_grad", "is_leaf", "is_cuda", "is_meta", "itemsize",
        "nbytes")),
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.element_size,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.get_device,
}


def resolve(x: Any) -> Any:
    """``x``, or the real tensor when it is a placeholder: for code that inspects a tensor's type
    (``isinstance(x, DTensor)``) before any operation would materialize it."""
    return x.owner.materialize(x.bucket)[x.pos] if isinstance(x, Lazy) else x


class Owner(Protocol):
    def materialize(self, bucket: int) -> list[torch.Tensor]: ...


class Lazy(torch.Tensor):
    """Leaf ``pos`` of ``bucket``, gathered by ``owner`` when an operation first needs it."""

    owner: Owner
    bucket: int
    pos: int

    @staticmethod
    def __new__(cls, like: torch.Tensor, shape: torch.Size, owner: Owner, bucket: int, pos: int) -> Lazy:
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=like.dtype, device=like.device,
                                                   requires_grad=like.requires_grad)
        self.owner, self.bucket, self.pos = owner, bucket, pos
        return self

    def __repr__(self) -> str:  # no data to print
        return f"Lazy(shape={tuple(self.shape)}, dtype={self.dtype}, bucket={self.bucket})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = tree_map_only(Lazy, resolve, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        raise RuntimeError(f"{func} reached a Lazy parameter placeholder below torch functions; it has no data")
