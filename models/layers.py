"""Building blocks shared by the reference models: RMSNorm, RoPE, attention, SwiGLU, loss, batches.

Every function here is plain tensor code that must also run unchanged on DTensors (tensor
parallelism shards heads/mlp/vocab). Three consequences shape the code:

* No plain constant tensors next to activations: DTensor refuses to mix a plain ``torch.Tensor``
  with a DTensor. Constants (positions, masks, one-hots) are built with ``x.new_ones(...)``,
  which gives a plain tensor for a plain ``x`` and a replicated DTensor on ``x``'s mesh otherwise.
* No ``.item()`` and no Python branching on tensor values: reductions stay tensor ops.
* Params meet activations in :func:`einsum` (``shardings.einsum``, re-exported): ``einops.einsum`` on
  plain tensors, each rank's blocks multiplied locally on DTensors whose layouts agree.

Numerics follow Hugging Face Llama (RMSNorm in float32, ``rotate_half`` RoPE, SDPA attention),
so converted checkpoints match its logits.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from shardings import attention as layout_attention
from shardings import blockwise, constrain, einsum, embedding, nll

__all__ = [
    "arange_like",
    "attention",
    "cross_entropy",
    "einsum",
    "embedding",
    "next_token_batch",
    "rms_norm",
    "rope",
    "swiglu",
]


def arange_like(x: torch.Tensor, n: int) -> torch.Tensor:
    """``torch.arange(n)`` (int64) of the same kind as ``x``: plain tensor, or replicated DTensor.

    >>> arange_like(torch.zeros(2), 4).tolist()
    [0, 1, 2, 3]
    """
    # torch.arange would be a plain tensor, which DTensor refuses to combine with a DTensor.
    return x.new_ones(n, dtype=torch.int64).cumsum(0) - 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 as in HF ``LlamaRMSNorm``.

    >>> round(rms_norm(torch.tensor([[3.0, 4.0]]), torch.ones(2), eps=0.0).pow(2).mean().item(), 4)
    1.0
    """
    return blockwise(functools.partial(_rms_norm, eps=eps), x, weight, whole=(-1,))  # local rows under a layout


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    # HF Llama convention: the head dim is two halves (x1, x2) -> (-x2, x1), not interleaved pairs.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x: torch.Tensor, theta: float, offset: int = 0) -> torch.Tensor:
    """Rotary position embedding of ``x: (batch, seq, heads, head_dim)`` at positions ``offset..offset+seq-1``
    (``offset``: the tokens before ``x``'s, as for a chunk of a sequence).

    cos/sin are computed on the fly from the positions (no buffers in params), in float32, with
    HF Llama's formula ``inv_freq = 1 / theta ** (arange(0, d, 2) / d)`` and ``rotate_half``.

    >>> y = rope(torch.ones(1, 3, 2, 4), theta=10000.0)
    >>> torch.allclose(y[:, 0], torch.ones(1, 2, 4))  # position 0 is not rotated
    True
    """
    if x.shape[-1] % 2:
        raise ValueError(f"rope: head_dim must be even, got {x.shape[-1]}. Fix: pick an even head_dim.")
    # Positions need the whole seq. A rotation's transpose is the rotation back: nothing saved for backward.
    rotate, back = (functools.partial(_rope, theta=theta, inverse=i, offset=offset) for i in (False, True))
    return blockwise(rotate, x, whole=(1, -1), transpose=back)


def _rope(x: torch.Tensor, theta: float, inverse: bool = False, offset: int = 0) -> torch.Tensor:
    seq, head_dim = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / (theta ** (arange_like(x, head_dim // 2).float() * 2 / head_dim))  # (head_dim/2,)
    freqs = (arange_like(x, seq) + offset).float()[:, None] * inv_freq[None, :]  # (seq, head_dim/2)
    angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (seq, 1, head_dim): broadcast over heads
    angles = -angles if inverse else angles
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal multi-head attention with grouped K/V (MHA, GQA and MQA), laid out by the active layout.

    :func:`shardings.attention`: ``F.scaled_dot_product_attention`` (a fused kernel: no ``seq × seq``
    scores saved) on one device and on each rank's heads under tp, or ring attention by the same
    kernel's blocks when the layout shards ``seq`` (cp). ``shardings.ops.ring_attention.reference_attention``
    (einsums, float32 softmax) is what the tests compare it with.

    Args:
        q: ``(batch, seq, heads, head_dim)``.
        k: ``(batch, seq, kv_heads, head_dim)``; ``kv_heads`` divides ``heads``.
        v: like ``k``.

    Returns:
        ``(batch, seq, heads, head_dim)``.

    >>> q = torch.randn(1, 5, 4, 8); kv = torch.randn(1, 5, 2, 8)
    >>> attention(q, kv, kv).shape
    torch.Size([1, 5, 4, 8])
    """
    return layout_attention(q, k, v, causal=True)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """SwiGLU feed-forward: ``(silu(x @ w_gate) * (x @ w_up)) @ w_down`` with the hidden annotated.

    >>> swiglu(torch.randn(2, 3, 4), torch.randn(4, 6), torch.randn(4, 6), torch.randn(6, 4)).shape
    torch.Size([2, 3, 4])
    """
    up = lambda w: einsum(x, w, "b s e, e f -> b s f")  # (batch, seq, mlp): column-parallel under tp
    hidden = constrain(F.silu(up(w_gate)) * up(w_up), ("batch", "seq", "mlp"))
    return einsum(hidden, w_down, "b s f, f e -> b s e")  # row-parallel under tp: partial sums over mlp


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Mean float32 cross-entropy over the labels that are not ``ignore_index``.

    Per token :func:`shardings.ops.vocab_parallel.nll`: on vocab-sharded logits each rank works on its own
    block and only per-token values are reduced (the vocab-parallel loss), never whole rows. A batch
    whose labels are all ignored gives 0, not NaN.

    Args:
        logits: ``(batch, seq, vocab)``.
        labels: int64 ``(batch, seq)``; ``ignore_index`` marks tokens that do not count.
        ignore_index: the label value to skip.

    Returns:
        A scalar float32 tensor.

    >>> round(cross_entropy(torch.zeros(1, 2, 4), torch.tensor([[1, -100]]), ignore_index=-100).item(), 4)  # log 4
    1.3863
    """
    keep = labels != ignore_index
    per_token = nll(logits, labels.masked_fill(~keep, -1))  # -1: outside the vocab, picks no logit
    keep = keep.float()
    return (per_token * keep).sum() / keep.sum().clamp(min=1.0)


def next_token_batch(
    vocab: int, seq_len: int, batch_size: int, seed: int, ignore_index: int, with_ignored: bool
) -> dict[str, torch.Tensor]:
    """A deterministic synthetic language-modelling batch: labels are the tokens shifted by one.

    ``seq_len + 1`` uniform tokens are drawn per row from a seeded generator (independent of the
    global RNG); ``tokens`` are the first ``seq_len`` and ``labels`` the last ``seq_len``. With
    ``with_ignored``, about one label in eight (always the first of each row) is ``ignore_index``.

    >>> b = next_token_batch(10, 4, 2, seed=0, ignore_index=-100, with_ignored=False)
    >>> torch.equal(b["tokens"][:, 1:], b["labels"][:, :-1])
    True
    """
    gen = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=gen)  # (batch, seq + 1)
    tokens, labels = seqs[:, :-1], seqs[:, 1:].clone()
    if with_ignored:
        drop = torch.rand(batch_size, seq_len, generator=gen) < 1 / 8
        drop[:, 0] = True
        labels[drop] = ignore_index
    return {"tokens": tokens.contiguous(), "labels": labels}
