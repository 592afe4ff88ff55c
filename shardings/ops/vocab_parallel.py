"""The vocab-parallel ends of a language model: the embedding lookup and the loss (``nll``, ``logsumexp``).

**logsumexp** over a dim a DTensor shards, without gathering it. DTensor's own ``torch.logsumexp``
over a sharded dim all-gathers the whole tensor first: for vocab-sharded logits, every rank then
holds (and moves) the full ``(batch, seq, vocab)`` logits. Split as Megatron's and
``loss_parallel``'s cross-entropy do, each rank works on its own block and only ``(batch, seq)``
values are reduced: the max (one all-reduce), then the sum of exponentials (another); backward
needs none. Plain tensors take ``torch.logsumexp``.

**nll**, the per-token cross-entropy, goes further on evenly vocab-sharded logits, as Megatron's
``VocabParallelCrossEntropy``: one autograd function on each rank's block reduces the max, the sum
of exponentials and the target logit (three ``(batch, seq)`` all-reduces), keeps only the logits'
block for backward and writes the gradient ``softmax − one_hot`` into one block-sized buffer, where
the composite form would hold a ``(batch, seq, vocab)`` one-hot and several gradient-sized temporaries.

**embedding** with vocab-sharded rows: each rank looks its tokens up in its own rows (zeros for the
others') and the result is ``Partial``; constraining it to the residual stream's layout then
reduce-scatters (sequence parallel) or all-reduces it, as torchtitan's ``RowwiseParallel``
embedding and Megatron's ``VocabParallelEmbedding``. That is DTensor's own ``F.embedding`` rule
(``MaskPartial``) when the tokens are replicated over the vocab's axes; where a rank's block of rows
would be empty (vocab 5 over tp=7) the rows are all-gathered first, in the open where
:func:`shardings.comms` counts them.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from shardings.comm import flat_comm as fc
from shardings.residency.lazy_params import resolve

__all__ = ["embedding", "logsumexp", "nll"]


def embedding(tokens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(tokens, weight)``; with ``weight``'s rows sharded, a ``Partial`` lookup (no gather).

    >>> embedding(torch.tensor([[2, 0]]), torch.eye(3)).tolist()
    [[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]]
    """
    weight = resolve(weight)  # a ZeRO-3 placeholder: gathered now
    if isinstance(weight, DTensor) and _an_empty_block(weight, 0):
        rows = [Replicate() if p.is_shard(0) else p for p in weight.placements]
        weight = weight.redistribute(weight.device_mesh, rows)  # DTensor's masked lookup needs >= 1 row per rank
    return F.embedding(tokens, weight)


def logsumexp(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.logsumexp(x, dim)``; on a DTensor sharded along ``dim``, computed block by block.

    >>> round(logsumexp(torch.zeros(4), 0).item(), 4)  # log 4
    1.3863
    """
    dim = dim % x.ndim
    if not isinstance(x, DTensor) or not any(p.is_shard(dim) for p in x.placements) or _an_empty_block(x, dim):
        return torch.logsumexp(x, dim)  # (an empty block has no max: DTensor's gathering op then)
    shift = _reduced(x.detach().amax(dim, keepdim=True))  # Partial(max) over the shards: reduced once, here
    return _reduced((x - shift).exp().sum(dim)).log() + shift.squeeze(dim)


def _an_empty_block(x: DTensor, dim: int) -> bool:
    blocks = math.prod([x.device_mesh.size(m) for m, p in enumerate(x.placements) if p.is_shard(dim)])
    per_block = -(-x.shape[dim] // blocks)  # torch.chunk's sizes: the last blocks may be short or empty
    return -(-x.shape[dim] // per_block) < blocks


def _reduced(x: DTensor) -> DTensor:
    # Partial -> Replicate (an all-reduce of (batch, seq) values); left to itself DTensor may
    # reduce-scatter instead, and backward then moves the (batch, seq, vocab) gradient to match.
    return x.redistribute(x.device_mesh, [Replicate() if p.is_partial() else p for p in x.placements])


def nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy ``logsumexp(logits) - logits[label]`` over the last dim, in float32.

    A label outside ``[0, vocab)`` (``ignore_index``) picks no logit: mask its token out. On logits
    whose last dim is evenly sharded (and no ``Partial``), block by block with three ``(batch, seq)``
    all-reduces (see the module docstring); other DTensors take the composite form.

    >>> [round(v, 4) for v in nll(torch.zeros(1, 2, 4), torch.tensor([[1, -100]]))[0].tolist()]  # log 4
    [1.3863, 1.3863]
    """
    x = logits.float()
    if not isinstance(x, DTensor):
        return _block_nll(x, labels, _vocab_ids(x), None)
    if isinstance(labels, DTensor):
        vocab_dims = tuple(m for m, p in enumerate(x.placements) if p.is_shard(x.ndim - 1))
        blocks = math.prod([x.device_mesh.size(m) for m in vocab_dims])
        plain = all(type(p) in (Shard, Replicate) for p in x.placements)
        if vocab_dims and plain and x.shape[-1] % blocks == 0:
            dm = x.device_mesh
            out = tuple(Replicate() if m in vocab_dims else p for m, p in enumerate(x.placements))
            labels = labels if tuple(labels.placements) == out else labels.redistribute(dm, out)
            ids = _vocab_ids(x)  # replicated
            split = [Shard(0) if m in vocab_dims else Replicate() for m in range(len(out))]
            ids = ids.redistribute(dm, split)  # each rank's block of them: a slice, no communication
            like = torch.empty(x.shape[:-1], device="meta")
            pending = tuple(Partial if m in vocab_dims else p for m, p in enumerate(out))
            reduce = functools.partial(_all_reduce, dm, pending, out, like)
            local = _block_nll(x.to_local(grad_placements=x.placements), labels.to_local(), ids.to_local(), reduce)
            return DTensor.from_local(local, dm, out, run_check=False, shape=like.shape, stride=like.stride())
    hits = labels[..., None] == _vocab_ids(x)  # (..., vocab) one-hot: uneven vocab blocks, Partial logits
    return logsumexp(x, dim=-1) - _reduced((x * hits).sum(-1))


def _vocab_ids(x: torch.Tensor) -> torch.Tensor:
    """``arange(vocab)`` of the kind of ``x``: a replicated DTensor beside a DTensor (which refuses a plain one)."""
    return x.new_ones(x.shape[-1], dtype=torch.int64).cumsum(0) - 1


def _all_reduce(dm: Any, pending: tuple, out: tuple, like: torch.Tensor, local: torch.Tensor, op: str) -> torch.Tensor:
    """Each rank's ``(batch, seq)`` block reduced with ``op`` over the mesh dims ``pending`` marks ``Partial``."""
    placements = [p(op) if p is Partial else p for p in pending]
    return fc.dtensor(local, dm, placements, like).redistribute(dm, out).to_local()


class _BlockNll(torch.autograd.Function):
    """:func:`nll` on one block of the vocab (local tensors): the (batch, seq) values are completed by
    ``all_reduce(value, op)`` over the other blocks (``None``: the block is the whole vocab);
    backward ``(softmax − one_hot)·g`` in one block-sized buffer, no collective.

    Forward and ``setup_context`` are separate (and the row statistics backward needs are extra,
    non-differentiable outputs), so ``torch.func.grad`` can differentiate through it; :func:`_block_nll`
    returns the value alone."""

    @staticmethod
    def forward(block: torch.Tensor, lab: torch.Tensor, ids: torch.Tensor, all_reduce: Any):
        reduce = all_reduce or (lambda value, op: value)
        shift = reduce(block.detach().amax(-1), "max")  # (batch, seq): the row max over all blocks
        log_sum = reduce((block - shift[..., None]).exp_().sum(-1), "sum").log()  # lse - shift, in [0, log vocab]
        idx = lab - ids[:1]  # the label's column in this block; in range in exactly one block
        hit = (idx >= 0) & (idx < block.shape[-1])
        idx = torch.where(hit, idx, 0)
        target = reduce(block.gather(-1, idx[..., None]).squeeze(-1) * hit, "sum")
        # lse = shift + log_sum is never formed: rounded at the logits' magnitude (ulp(1e4) ~ 1e-3), it would
        # make softmax = exp(x - lse) ~5e-4 off on large logits; x - shift and shift - target are exact
        return (shift - target) + log_sum, shift, log_sum, idx, hit

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, shift, log_sum, idx, hit = output
        ctx.save_for_backward(inputs[0], shift, log_sum, idx, hit)
        ctx.mark_non_differentiable(shift, log_sum, idx, hit)

    @staticmethod
    def backward(ctx, g: torch.Tensor, *_):
        block, shift, log_sum, idx, hit = ctx.saved_tensors
        grad = (block - shift[..., None]).sub_(log_sum[..., None]).exp_().mul_(g[..., None])  # softmax · g
        grad.scatter_add_(-1, idx[..., None], (-g * hit)[..., None])  # − one_hot · g
        return grad, None, None, None


def _block_nll(block: torch.Tensor, lab: torch.Tensor, ids: torch.Tensor, all_reduce: Any) -> torch.Tensor:
    return _BlockNll.apply(block, lab, ids, all_reduce)[0]
