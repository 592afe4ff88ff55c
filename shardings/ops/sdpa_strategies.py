"""DTensor sharding strategies for the CPU flash-attention kernels (registered on import).

``F.scaled_dot_product_attention`` on CPU runs ``aten._scaled_dot_product_flash_attention_for_cpu``
and, in backward, ``..._for_cpu_backward``. DTensor registers strategies for the CUDA kernels
(flash, efficient, cuDNN) but not for these: the forward falls back to tracing its decomposition
(which gathers the heads), and the backward has neither, so any model that calls attention on
DTensors failed in backward on CPU (``nn.MultiheadAttention`` under ``tp``, for one). Attention
is independent per example and per head, so, as for the CUDA kernels, each mesh dim may keep
everything whole, split the batch dim (0), or split the heads dim (1): no communication. A split
of the query rows (dim 2, sequence parallelism's layout) is offered too, with whole keys and
values, so that sequence parallelism's queries need no redistribution.

The mask is a keyword argument (``attn_mask``), and DTensor never redistributes keyword
arguments, so a strategy is valid only where it takes the mask exactly as it already is (q, k
and v, positional, are redistributed to match it); the mask is in the sharding cache's key.

One more fix, for any redistribution of q: DTensor computes an op's output metadata from its
inputs *before* redistributing them, and this kernel's output has the query's strides.
``nn.MultiheadAttention``'s query is a transposed view; redistributed (gathered), its local copy
is contiguous, the output's local strides no longer matched DTensor's, and a later ``view``
failed (``nn.MultiheadAttention`` under ``tp+sp`` with a mask). The forward makes q, k and v
contiguous first (a local copy, only where they are not), through DTensor's table of custom op
handlers (as ``torch.distributed.tensor.parallel.loss_parallel`` does).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from shardings.runtime.compat import OpSchema, OpStrategy, RuntimeSchemaInfo, expand_to_full_mesh_op_strategy

# register_sharding's own machinery (torch.distributed.tensor.experimental), which has no way to
# filter strategy combinations across mesh dims; the mask rule needs one

__all__ = ["attention_placements"]

_aten = torch.ops.aten


def attention_placements(mask_shape: tuple[int, ...] | None, *, causal: bool = False,
                         backward: bool = False) -> list[list[Any]]:
    """For one mesh dim: ``[*output placements, *input placements]`` the CPU attention kernel accepts.

    Forward: ``(out, logsumexp)`` from ``(q, k, v)``; backward: ``(dq, dk, dv)`` from ``(grad_out, q,
    k, v, out, logsumexp)``; each shaped ``(batch, heads, seq, ...)``, then the mask if any. All
    whole, or split by batch (dim 0), or by heads (dim 1), or by query rows (dim 2, not when
    ``causal``: the kernel's causal mask counts local rows): k and v then whole, their gradients
    ``Partial`` (sequence parallelism's layout; every rank's queries add to them). A mask of
    ``mask_shape`` broadcasts against ``(batch, heads, seq_q, seq_k)`` from the right: split with the
    others where it has the dim, whole where it broadcasts (size 1 or absent).

    >>> [str(p) for p in attention_placements((4, 1, 6, 6))[2]]  # heads split: a one-head mask stays whole
    ['S(1)', 'S(1)', 'S(1)', 'S(1)', 'S(1)', 'R']
    """
    choices = []
    for split in (Replicate(), Shard(0), Shard(1), *(() if causal else (Shard(2),))):
        kv, kv_grad = (Replicate(), Partial()) if split == Shard(2) else (split, split)
        if backward:
            placements = [split, kv_grad, kv_grad, split, split, kv, kv, split, split]
        else:
            placements = [split, split, split, kv, kv]
        if mask_shape is not None:
            dim = split.dim - (4 - len(mask_shape)) if isinstance(split, Shard) else -1
            placements.append(Shard(dim) if dim >= 0 and mask_shape[dim] > 1 else Replicate())
        choices.append(placements)
    return choices


def _strategy(backward: bool, op_schema: OpSchema) -> OpStrategy:
    mask = op_schema.kwargs_schema.get("attn_mask")
    mask_spec = mask.strategies[0].output_spec if isinstance(mask, OpStrategy) else None
    args = op_schema.args_schema
    causal = len(args) > _CAUSAL[backward] and bool(args[_CAUSAL[backward]])

    def mask_as_it_is(inputs: list, outputs: Any) -> bool:
        return mask_spec is None or tuple(inputs[-1].placements) == tuple(mask_spec.placements)

    strategy = expand_to_full_mesh_op_strategy(
        op_schema.get_mesh_from_args(),
        op_schema,
        attention_placements(None if mask_spec is None else tuple(mask_spec.shape), causal=causal, backward=backward),
        input_index=3 if backward else 2,
        is_valid_strategy_cb=mask_as_it_is,
    )
    if not strategy.strategies:  # DTensor's own message would be "min() arg is an empty sequence"
        raise ValueError(
            f"the attention mask of shape {tuple(mask_spec.shape)} is laid out {tuple(mask_spec.placements)}, "
            "split on a dim that is not the batch (0), heads (1) or query rows (2) of (batch, heads, seq_q, "
            "seq_k); constrain the mask whole or split like the batch"
        )
    return strategy


_CAUSAL = {False: 4, True: 7}  # is_causal's position in the forward's and the backward's arguments


def _register(op: Any, backward: bool) -> None:
    # is_causal and the mask (a keyword) decide the strategy, so both are in the sharding cache's key;
    # without the mask there, a decision made for one layout of it was reused for another (a wrong result)
    info = RuntimeSchemaInfo(static_argnum=_CAUSAL[backward], static_kwargkey=["attn_mask"], needs_pytree=True)
    DTensor._op_dispatcher.sharding_propagator.register_op_strategy(
        op, lambda op_schema: _strategy(backward, op_schema), info
    )


def _contiguous_qkv(op_call: Any, args: tuple, kwargs: dict) -> Any:
    """The forward on contiguous q, k and v, then DTensor's usual dispatch (this handler set aside for it)."""
    args = tuple(x.contiguous() if i < 3 and isinstance(x, DTensor) else x for i, x in enumerate(args))
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handler = handlers.pop(op_call)
    try:
        return op_call(*args, **kwargs)
    finally:
        handlers[op_call] = handler


_register(_aten._scaled_dot_product_flash_attention_for_cpu.default, backward=False)
_register(_aten._scaled_dot_product_flash_attention_for_cpu_backward.default, backward=True)
DTensor._op_dispatcher._custom_op_handlers[_aten._scaled_dot_product_flash_attention_for_cpu.default] = _contiguous_qkv
