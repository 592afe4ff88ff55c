"""inductor's decompositions, where a DTensor's local block needs them to lay out their result as the op does.

DTensor runs an op twice over: its sharding propagation computes the result's *global* shape and strides from the
op's meta function on the global shapes, and each rank runs the op on its *local* block. Under ``torch.compile``
with inductor, AOTAutograd traces the local op through inductor's decomposition table, so a decomposition whose
result is laid out otherwise than the op's own leaves a DTensor whose global strides disagree with its block's.
A later ``reshape`` then decides "view" from the global strides, and the view of the block fails.

``aten.cat`` of one tensor is such a decomposition (torch 2.13): inductor turns it into ``clone()``, which keeps the
input's strides, while ``aten.cat`` (kernel and meta) lays its result out by ``suggest_memory_format``: contiguous for
a permuted input. GPT-2 as researchers write it met it under ``zero3+tp+sp`` and ``zero3+tp+pp``:
``keys = torch.cat([k], dim=2)`` of ``k = torch.einsum("bse,ehd->bhsd", ...)`` (a block of shape ``(4, 2, 8, 8)``
laid out ``(b, s, h, d)``, strides ``(128, 8, 16, 1)``) came out of the decomposition with those strides while
DTensor recorded the contiguous global ``(256, 64, 8, 1)``; ``q @ keys.transpose(-2, -1)`` (``torch._decomp``'s
matmul) reshapes the keys to ``(b·h, d, s)``, a view by the global strides, and the block's view raised "Cannot view
a tensor with shape torch.Size([4, 2, 8, 8]) and strides (128, 8, 1, 16) as a tensor with shape (8, 8, 8)".
``aot_eager`` (no decompositions) and the eager step ran the real ``aten.cat`` and never met it.

:data:`INDUCTOR` is the ``torch.compile`` backend ``train_step(jit=True)`` uses for ``jit_backend="inductor"``:
inductor with the decompositions below in place of its own, for that step's graphs only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardings.runtime.compat import inductor_with, suggest_memory_format

__all__ = ["INDUCTOR", "cat"]


def cat(inductors: Callable, tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """inductor's ``aten.cat`` decomposition (``inductors``), its result laid out as ``aten.cat`` lays it out: in
    ``suggest_memory_format`` of the result (of its one input, when inductor's shortcut kept the input's strides)."""
    out = inductors(tensors, dim)
    if not isinstance(out, torch.Tensor):  # NotImplemented: aten.cat itself runs
        return out
    layout = suggest_memory_format(out)
    return out if out.is_contiguous(memory_format=layout) else out.contiguous(memory_format=layout)


INDUCTOR = inductor_with({torch.ops.aten.cat.default: cat})
