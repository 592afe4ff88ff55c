"""``blockwise``: a row-wise function on each rank's local block, with no DTensor op inside.

A norm, RoPE or an activation treats some dims as independent rows: splitting them over ranks and
applying the function to each block gives the blocks of the result. When the DTensor layout only
splits such dims, each rank can run the function on its plain local tensors, as torchtitan's
modules do between their ``use_local_output`` linears. That skips DTensor's sharding propagation on
every op in forward and backward (it dominates eager step time on small blocks), and it is
exactly the computation DTensor would run on each block, so values do not change.

Gradients follow DTensor's own rules: an argument laid out like ``x`` gets its gradient laid out
the same way; a replicated argument (a norm weight) that met a sharded ``x`` saw only this rank's
rows, so its gradient is ``Partial`` over the axes that split ``x``. Backward recomputes the function
on the blocks (cheap next to the matmuls around it), so only the DTensor inputs are saved and
ZeRO-3's saved-tensor hooks see a gathered weight as itself; a linear function (RoPE) may give its
transpose instead, and then nothing is saved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from shardings.ops.local_einsum import wrap_block
from shardings.residency.lazy_params import resolve

__all__ = ["blockwise"]


def blockwise(
    f: Callable[..., torch.Tensor],
    x: torch.Tensor,
    *args: torch.Tensor,
    whole: tuple[int, ...],
    transpose: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``f(x, *args)``, computed on each rank's local blocks when the layouts allow it.

    ``f`` must treat every dim of ``x`` not in ``whole`` as independent rows and return a tensor
    of ``x``'s shape. The local path runs when ``x`` is a DTensor split only over dims outside
    ``whole`` (no ``Partial``), and each of ``args`` is a DTensor on ``x``'s mesh that is either laid
    out like ``x`` (same shape and placements) or replicated wherever ``x`` is split. Otherwise, and
    for plain tensors, it is simply ``f(x, *args)`` on the tensors as given: never wrong, only slower.

    Args:
        f: the per-block function, e.g. RMSNorm over the last dim.
        x: the input that decides the layout of the result.
        *args: more inputs: blocks laid out like ``x``, or replicated tensors (weights).
        whole: the dims of ``x`` that ``f`` mixes (reduces over, or indexes by position).
        transpose: for an ``f`` linear in ``x`` (and no ``args``), its transpose on a block: the
            gradient of ``x`` from the output's. Backward then saves and recomputes nothing.

    Returns:
        ``f(x, *args)``: a DTensor laid out like ``x`` on the local path.

    Raises:
        ValueError: on the local path, ``f`` returned a block of another shape than ``x``'s;
            ``transpose`` given with ``args``.

    >>> with simulate(2):
    ...     x = shard(torch.randn(4, 8), P("dp"), Mesh(dp=2))
    ...     spec_of(blockwise(lambda t: t.softmax(-1), x, whole=(-1,)))
    P('dp')
    """
    if transpose is not None and args:
        raise ValueError(
            f"blockwise: transpose is for a function of x alone, but {len(args)} more inputs were given. Fix: "
            "drop transpose (backward then recomputes f), or pass only x."
        )
    x, args = resolve(x), tuple(resolve(a) for a in args)  # ZeRO-3 placeholders: gathered now
    grads = _grad_placements(x, args, whole)
    if grads is None:
        return f(x, *args)
    if torch.compiler.is_compiling():
        return _traced_blockwise(f, grads, x, *args)
    return _Blockwise.apply(f, transpose, grads, x, *args)


def _traced_blockwise(f: Callable[..., torch.Tensor], grads: list[tuple[Placement, ...]], x: DTensor,
                      *args: DTensor) -> DTensor:
    """:class:`_Blockwise` as torch.compile traces it (``train_step(jit=True)``): ``f`` on the blocks between
    DTensor's own ``to_local``/``from_local``, whose backward lays the gradients out as :class:`_Blockwise`'s
    does (``x``'s like ``x``, each weight's as ``grads`` says); what backward saves or recomputes is the
    compiler's choice."""
    blocks = [t.to_local(grad_placements=g) for t, g in zip((x, *args), (x.placements, *grads), strict=True)]
    out = _checked(f(*blocks), blocks[0])
    return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())


class _Blockwise(torch.autograd.Function):
    """``f`` on the local blocks. Backward applies ``transpose`` to the cotangent block, or recomputes
    ``f`` on the saved inputs' blocks and differentiates that: only the DTensor inputs are saved, so
    ZeRO-3's saved-tensor hooks see a gathered weight as itself."""

    @staticmethod
    def forward(ctx: Any, f: Callable, transpose: Callable | None, grads: list, *inputs: DTensor) -> DTensor:
        x = inputs[0]
        ctx.f, ctx.transpose = f, transpose
        ctx.layouts = [(t.device_mesh, p, tuple(t.shape)) for t, p in zip(inputs, (x.placements, *grads))]
        if transpose is None:
            ctx.save_for_backward(*inputs)
        out = _checked(f(*(t._local_tensor for t in inputs)), x._local_tensor)
        return wrap_block(out, x.device_mesh, x.placements, tuple(x.shape))

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor | None, ...]:
        mesh, placements, _ = ctx.layouts[0]
        if tuple(grad.placements) != tuple(placements):
            grad = grad.redistribute(mesh, placements)
        needs = ctx.needs_input_grad[3:]
        if ctx.transpose is not None:
            local = iter([ctx.transpose(grad._local_tensor)])
        else:
            with torch.enable_grad():
                blocks = [t._local_tensor.detach().requires_grad_(n) for t, n in zip(ctx.saved_tensors, needs)]
                out = ctx.f(*blocks)
                wanted = [b for b in blocks if b.requires_grad]
                local = iter(torch.autograd.grad(out, wanted, grad._local_tensor) if wanted else ())
        grads = (wrap_block(next(local), *layout) if need else None for layout, need in zip(ctx.layouts, needs))
        return None, None, None, *grads


def _checked(out: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """``out``, which ``f`` returned for ``x``'s local ``block``; raises unless it has the block's shape."""
    if out.shape != block.shape:
        raise ValueError(
            f"blockwise: f returned a block of shape {tuple(out.shape)} for an input block of shape "
            f"{tuple(block.shape)}; f must keep the shape of x. Fix: compute shape-changing steps outside blockwise."
        )
    return out


def _grad_placements(x: Any, args: tuple[Any, ...], whole: tuple[int, ...]) -> list[tuple[Placement, ...]] | None:
    """Each of ``args``' gradient placements on the local path, or ``None`` when the layouts do not allow it."""
    if not isinstance(x, DTensor) or not all(isinstance(a, DTensor) and a.device_mesh == x.device_mesh for a in args):
        return None
    kept = {d % x.ndim for d in whole}
    ranks: dict[int, int] = {}  # tensor dim -> how many blocks the mesh dims splitting it make
    for m, p in enumerate(x.placements):
        if not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim not in kept)):
            return None
        if isinstance(p, Shard):
            ranks[p.dim] = ranks.get(p.dim, 1) * x.device_mesh.size(m)
    if any(x.shape[d] % n for d, n in ranks.items()):
        return None  # uneven blocks (2 rows over tp×cp = 4) differ in shape between ranks: DTensor ops instead
    grads = []
    for a in args:
        like_x = a.shape == x.shape
        if not all((pa == px and like_x) or isinstance(pa, Replicate) for pa, px in zip(a.placements, x.placements)):
            return None
        # a replicated weight that met rows split over an axis saw only this rank's rows: partial sums there
        grads.append(
            tuple(Partial() if isinstance(px, Shard) and pa != px else pa for pa, px in zip(a.placements, x.placements))
        )
    return grads
