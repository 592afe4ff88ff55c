"""The vocab-parallel ends of a language model: the embedding lookup and the loss's ``logsumexp``.

**logsumexp** over a dim a DTensor shards, without gathering it. DTensor's own ``torch.logsumexp``
over a sharded dim all-gathers the whole tensor first: for vocab-sharded logits, every rank then
holds (and moves) the full ``(batch, seq, vocab)`` logits. Split as Megatron's and
``loss_parallel``'s cross-entropy do, each rank works on its own block and only ``(batch, seq)``
values are reduced: the max (one all-reduce), then the sum of exponentials (another); backward
needs none. Plain tensors take ``torch.logsumexp``.

**embedding** with vocab-sharded rows: each rank looks its tokens up in its own rows (zeros for the
others') and the result is ``Partial``; constraining it to the residual stream's layout then
reduce-scatters (sequence parallel) or all-reduces it, as torchtitan's ``RowwiseParallel``
embedding and Megatron's ``VocabParallelEmbedding``. That is DTensor's own ``F.embedding`` rule
(``MaskPartial``) when the tokens are replicated over the vocab's axes; where a rank's block of rows
would be empty (vocab 5 over tp=7) the rows are all-gathered first, in the open where
:func:`shardings.comms` counts them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["embedding", "logsumexp"]


def embedding(tokens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(tokens, weight)``; with ``weight``'s rows sharded, a ``Partial`` lookup (no gather).

    >>> embedding(torch.tensor([[2, 0]]), torch.eye(3)).tolist()
    [[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]]
    """
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
    blocks = math.prod(x.device_mesh.size(m) for m, p in enumerate(x.placements) if p.is_shard(dim))
    per_block = -(-x.shape[dim] // blocks)  # torch.chunk's sizes: the last blocks may be short or empty
    return -(-x.shape[dim] // per_block) < blocks


def _reduced(x: DTensor) -> DTensor:
    # Partial -> Replicate (an all-reduce of (batch, seq) values); left to itself DTensor may
    # reduce-scatter instead, and backward then moves the (batch, seq, vocab) gradient to match.
    return x.redistribute(x.device_mesh, [Replicate() if p.is_partial() else p for p in x.placements])
