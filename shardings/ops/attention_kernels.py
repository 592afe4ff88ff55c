"""Fused attention kernels on plain tensors: whole sequences, and blocks that return their log-sum-exp.

Tensors are ``(batch, seq, heads, head_dim)`` as the models lay them out; the kernels take
``(batch, heads, seq, head_dim)`` and the transposes in between are views.

* :func:`fused` is ``F.scaled_dot_product_attention`` (flash / memory-efficient / cuDNN on a GPU,
  the flash kernel on CPU). Grouped K/V go in as they are (``enable_gqa``), so no repeated copy is
  made where the kernel reads groups itself (CPU flash, and the GPU kernels that support it).
* :func:`block_forward` / :func:`block_backward` are what ring attention runs per block: the forward
  also returns the block's log-sum-exp, so blocks merge by it; the backward takes the *merged*
  output and log-sum-exp, which makes each block's ``dq, dk, dv`` exact parts of the whole's (as
  torch's own context parallelism does). ``causal`` here masks a square block top-left (query ``i``
  sees keys ``j <= i``), which is the diagonal block of the ring.

On CPU the blocks run ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (K/V
groups read in place). On other devices they run the memory-efficient kernel with K/V repeated to
the query heads and the gradients summed back per group; that path has not run in this
repository's CI, which has no GPU.
"""

from __future__ import annotations

import einops
import torch
import torch.nn.functional as F

__all__ = ["accumulator", "block_backward", "block_forward", "fused"]

_aten = torch.ops.aten


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype blocks merge in, and of the log-sum-exp: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _heads_first(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [x.transpose(1, 2) for x in xs]


def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
          mask: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(q kᵀ/√d) v`` by the fused kernel; ``mask (seq_q, seq_k)`` True = visible replaces ``causal``.

    Causal with K/V longer than q (a prefix of ``p`` keys before the queries: TeraPipe's chunks) aligns the
    queries with the last keys, query ``s`` seeing keys ``t <= p + s``: an explicit mask, as the kernel's own
    ``is_causal`` aligns them with the first.

    >>> q = torch.randn(1, 6, 4, 8); kv = torch.randn(1, 6, 2, 8)
    >>> fused(q, kv, kv, causal=True).shape
    torch.Size([1, 6, 4, 8])
    """
    gqa = k.shape[2] != q.shape[2]
    if causal and mask is None and k.shape[1] != q.shape[1]:
        prefix = k.shape[1] - q.shape[1]
        mask = q.new_ones((q.shape[1], k.shape[1]), dtype=torch.bool).tril(prefix)  # q's kind (a LocalTensor)
    out = F.scaled_dot_product_attention(*_heads_first(q, k, v), attn_mask=mask, is_causal=causal and mask is None,
                                         enable_gqa=gqa)
    return out.transpose(1, 2)


def _repeat(x: torch.Tensor, heads: int) -> torch.Tensor:
    return einops.repeat(x, "b t k d -> b t (k g) d", g=heads // x.shape[2])  # query head h reads kv head h // g


def _group_sum(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    return einops.reduce(x, "b t (k g) d -> b t k d", "sum", k=kv_heads)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: ``out (b, s, h, d)`` in q's dtype and ``lse (b, h, s)`` in :func:`accumulator` dtype."""
    if q.device.type == "cpu":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(*_heads_first(q, k, v), 0.0, causal, scale=scale)
        return out.transpose(1, 2), lse.to(accumulator(q.dtype))
    k, v = _repeat(k, q.shape[2]), _repeat(v, q.shape[2])
    out, lse, *_ = _aten._scaled_dot_product_efficient_attention(*_heads_first(q, k, v), None, True, 0.0, causal,
                                                                 scale=scale)
    # the kernel pads lse's seq to a multiple of 32
    return out.transpose(1, 2), lse[..., : q.shape[1]].to(accumulator(q.dtype))


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's part of ``dq, dk, dv`` given the merged ``out`` (q's dtype) and ``lse`` of its rows."""
    if q.device.type == "cpu":
        grads = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *_heads_first(dout, q, k, v, out), lse.to(accumulator(q.dtype)).contiguous(), 0.0, causal, scale=scale)
        return tuple(g.transpose(1, 2) for g in grads)
    kv_heads = k.shape[2]
    k, v = _repeat(k, q.shape[2]), _repeat(v, q.shape[2])
    padded = F.pad(lse.float(), (0, -(-q.shape[1] // 32) * 32 - q.shape[1])).contiguous()
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        *_heads_first(dout, q, k, v), None, out.transpose(1, 2), padded,
        torch.zeros((), dtype=torch.int64, device=q.device), torch.zeros((), dtype=torch.int64, device=q.device),
        0.0, (True, True, True, False), causal, scale=scale)
    return dq.transpose(1, 2), _group_sum(dk.transpose(1, 2), kv_heads), _group_sum(dv.transpose(1, 2), kv_heads)
