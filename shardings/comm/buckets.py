"""Bucketed gradient reduction: one all-reduce per bucket of flattened gradients, not one per leaf.

Gradients that are still ``Partial`` after backward and must become replicated (``dp``, and the
data-parallel part of ``dp+tp``) are grouped by (mesh, placements, dtype), packed in order into
flat buckets of at most ``bucket_mb`` megabytes, reduced with one collective each, and split back
into the original shapes. Summing a concatenation is summing its pieces, so results are bitwise
the ones a per-leaf reduction gives. Everything else — reduce-scatters into sharded optimizer
state, gradients already reduced in backward — goes through ``redistribute`` one leaf at a time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from shardings.spec.errors import sharding_error

__all__ = ["DEFAULT_BUCKET_MB", "Bucket", "plan", "reduce"]

DEFAULT_BUCKET_MB = 25.0


class Bucket(NamedTuple):
    """Leaves reduced together by one collective.

    Attributes:
        leaves: indices of the gradients packed in this bucket, in order.
        source: their (shared) placements before the reduction (some ``Partial``).
        target: their placements after it: ``source`` with ``Partial`` made ``Replicate`` (a leaf
            whose final placement shards a replicated dim takes its local chunk afterwards, no comm).
        nbytes: bytes of the flat local buffer per rank.
    """

    leaves: tuple[int, ...]
    source: tuple[Placement, ...]
    target: tuple[Placement, ...]
    nbytes: int


def _reduced(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def _bucketable(g: DTensor, target: Sequence[Placement]) -> bool:
    # Only Partial -> Replicate on some mesh dims (then Replicate -> Shard is a local chunk), the
    # rest unchanged; shards must be even so every rank packs the same number of elements.
    src = g.placements
    if not any(isinstance(p, Partial) for p in src):
        return False
    if not all(s == t or (isinstance(s, Partial) and isinstance(t, Replicate))
               or (isinstance(s, Replicate) and isinstance(t, Shard)) for s, t in zip(src, target)):
        return False
    ways = [1] * g.ndim
    for i, p in enumerate(src):
        if isinstance(p, Shard):
            if type(p) is not Shard:  # strided/interleaved shards: leave them to redistribute
                return False
            ways[p.dim] *= g.device_mesh.size(i)
    return all(n % w == 0 for n, w in zip(g.shape, ways))


def _local_numel(g: DTensor) -> int:
    ways = [1] * g.ndim
    for i, p in enumerate(g.placements):
        if isinstance(p, Shard):
            ways[p.dim] *= g.device_mesh.size(i)
    return math.prod(n // w for n, w in zip(g.shape, ways))


def plan(grads: Sequence[torch.Tensor], targets: Sequence[Sequence[Placement]],
         bucket_mb: float | None = DEFAULT_BUCKET_MB, dtype: torch.dtype | None = None) -> list[Bucket]:
    """The buckets :func:`reduce` will use for ``grads`` going to ``targets``.

    A leaf larger than the cap gets a bucket of its own; ``bucket_mb=None`` or ``0`` means no
    buckets (every leaf is reduced alone by ``redistribute``).

    Args:
        grads: gradients (DTensors; others are never bucketed).
        targets: each gradient's placements after the reduction.
        bucket_mb: the cap of one bucket's flat buffer, in MB (10**6 bytes).
        dtype: the dtype floating gradients are reduced in (:func:`reduce` casts them); ``None``: their own.

    Returns:
        The buckets, in the order their collectives run.

    >>> [b.leaves for b in plan(grads, [(Replicate(),)] * len(grads), bucket_mb=25)]  # doctest: +SKIP
    [(0, 1, 2)]
    """
    if bucket_mb is not None and bucket_mb < 0:
        raise sharding_error(f"bucket_mb={bucket_mb} is negative", fix="pass bucket_mb > 0, or 0/None for no buckets",
                             cls=ValueError)
    if not bucket_mb:
        return []
    cap = bucket_mb * 1e6
    open_: dict[tuple, list] = {}  # key -> [leaf indices, nbytes]
    done: list[Bucket] = []
    for i, (g, tgt) in enumerate(zip(grads, targets)):
        if not isinstance(g, DTensor) or not _bucketable(g, tgt):
            continue
        reduced_dtype = _dtype(g, dtype)
        key = (id(g.device_mesh), tuple(g.placements), _reduced(g.placements), reduced_dtype)
        nbytes = _local_numel(g) * reduced_dtype.itemsize
        cur = open_.get(key)
        if cur is not None and cur[1] + nbytes > cap:
            done.append(Bucket(tuple(cur[0]), key[1], key[2], cur[1]))
            cur = None
        if cur is None:
            cur = open_[key] = [[], 0]
        cur[0].append(i)
        cur[1] += nbytes
    done += [Bucket(tuple(idx), k[1], k[2], n) for k, (idx, n) in open_.items()]
    return sorted(done, key=lambda b: b.leaves[0])


def _flat_placements(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    # The flat buffer only moves over the Partial dims; a Shard dim's local data stays local.
    return tuple(p if isinstance(p, Partial) else Replicate() for p in placements)


def _dtype(g: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and g.is_floating_point() else g.dtype


def _reduce_bucket(grads: Sequence[DTensor], bucket: Bucket, dtype: torch.dtype | None) -> list[DTensor]:
    parts = [grads[i] for i in bucket.leaves]
    mesh = parts[0].device_mesh
    locals_ = [g.to_local() for g in parts]
    flat = torch.cat([x.reshape(-1) for x in locals_]).to(_dtype(parts[0], dtype))  # (sum of local numels,)
    buf = DTensor.from_local(flat, mesh, _flat_placements(bucket.source), run_check=False,
                             shape=flat.shape, stride=(1,))
    out = buf.redistribute(mesh, _flat_placements(bucket.target)).to_local()
    pieces = out.split([x.numel() for x in locals_])
    return [
        DTensor.from_local(p.view(x.shape), mesh, bucket.target, run_check=False, shape=g.shape, stride=g.stride())
        for p, x, g in zip(pieces, locals_, parts)
    ]


def reduce(grads: Sequence[torch.Tensor], targets: Sequence[Sequence[Placement]],
           bucket_mb: float | None = DEFAULT_BUCKET_MB, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """``[g.to(dtype).redistribute(mesh, t) for g, t in zip(grads, targets)]``, with one collective per bucket.

    Args:
        grads: gradients as DTensors (typically ``Partial`` over the data axes).
        targets: each gradient's placements after the reduction.
        bucket_mb: bucket cap in MB; ``None``/``0``: one redistribute per leaf.
        dtype: the dtype floating gradients are reduced in (a precision policy's reduce dtype), cast one bucket
            (or leaf) at a time as it is reduced: a copy of every gradient in it is never held at once.
            ``None``: their own dtype.

    Returns:
        The reduced gradients, in the order of ``grads``; values equal the per-leaf reduction.

    >>> reduced = reduce(grads, [(Replicate(),)] * len(grads))  # doctest: +SKIP
    """
    out: list[torch.Tensor | None] = [None] * len(grads)
    for b in plan(grads, targets, bucket_mb, dtype):
        for i, r in zip(b.leaves, _reduce_bucket(grads, b, dtype)):
            out[i] = r
    for i, tgt in enumerate(targets):
        g = grads[i].to(_dtype(grads[i], dtype)) if out[i] is None else out[i]
        out[i] = g if tuple(g.placements) == tuple(tgt) else g.redistribute(g.device_mesh, tgt)
    return out
