"""ZeRO-3 on the DTensor path in buckets: one all-gather per bucket forward, one reduce-scatter backward.

:func:`~shardings.residency.gather_params.to_compute` gathers one parameter per collective. Layouts that also
split model axes (``zero3+tp+sp``) run the train step on DTensors, where that is a collective and a
wait for every weight, and again for every gradient. Here each parameter whose storage differs from
its compute layout only on one mesh dim, a plain ``Shard(d)`` there gathered to ``Replicate`` (the
ZeRO-3 gather over the data axis), joins a bucket of its mesh dim and dtype. A bucket's local blocks
are packed into one flat buffer, all-gathered once (:mod:`shardings.comm.flat_comm`) and split back into
DTensors in the compute layout; other mesh dims (tp) keep their blocks untouched. The bucket's
backward reduce-scatters all its gradients that come back ``Partial`` over that dim with one
collective. Gathered weights are registered with :func:`~shardings.residency.gather_params.regather_in_backward`,
so autograd keeps none of them alive: the first weight backward needs gathers the whole bucket again
(one collective), held until the bucket's own backward has run.

Communication overlaps as on the local path (:mod:`shardings.step.local_step`): the loss gets
placeholders (:mod:`shardings.residency.lazy_params`), a bucket is gathered when first used while the next
one's gather is in flight, and a block's weights are dropped when the next block's are needed; in
backward, re-gathering a bucket launches the gather of the bucket backward needs next (the reverse
of the order autograd first saved them in: :class:`~shardings.residency.gather_params.Regather`); a bucket's
reduce-scatter is launched and left in flight, its gradients are views of the pending result, awaited
by :func:`settle` once backward is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from shardings.comm import flat_comm as fc
from shardings.residency.gather_params import Regather, active, to_compute
from shardings.residency.lazy_params import Gathers
from shardings.runtime.compat import funcol

__all__ = ["gather"]


def gather(shards: Sequence[DTensor], placements: Sequence[Any], bucket_mb: float | None,
           units: Sequence[Any] | None = None, cast: Any = None) -> tuple[list[DTensor], Gathers]:
    """``[to_compute(s, p) for s, p in zip(shards, placements)]`` with one all-gather per bucket
    (buckets never mix ``units``: see ``local_step.plan``), and the owner of the forward gathers,
    for :func:`settle` to close after backward.

    ``cast`` (a ``shardings.step.mixed.Cast``): a bucket's blocks are cast to its compute dtype before
    they are gathered, and its gradients to its reduce dtype before they are reduce-scattered. Leaves
    gathered one at a time (``bucket_mb`` falsy, uneven splits) and the leaves not gathered are returned in
    their own dtype: the caller casts those after.

    >>> compute, gathers = gather(leaves, plan.placements["compute"], bucket_mb=25)  # doctest: +SKIP
    """
    out: list[DTensor] = list(shards)
    at: dict[int, tuple[int, int]] = {}
    for i, (s, pl) in enumerate(zip(shards, placements)):
        where = _gathered_at(s, pl) if bucket_mb else None
        if where is None:
            out[i] = to_compute(s, pl)
        else:
            at[i] = where
    bucketed, kept = fc.unit_buckets(list(at), shards, lambda i: (at[i][0], shards[i].dtype), bucket_mb, units)
    buckets = [_Bucket(tuple(at[i] for i in b), tuple(tuple(placements[i]) for i in b),
                       [shards[i].detach() for i in b], cast) for b in bucketed]
    regather = active()

    def build(k: int, flat: torch.Tensor) -> tuple[DTensor, ...]:
        bucket = buckets[k]
        fulls = _GatherBucket.apply(bucket, flat, *(shards[i] for i in bucketed[k]))
        if k not in kept and regather is not None:  # else autograd keeps them: no backward re-gather
            bucket.regather = regather, regather.add(fulls, bucket.launch, bucket.assemble)
        return fulls

    forward = Gathers(len(buckets), kept, lambda k: buckets[k].launch(), build)
    for i, x in forward.placeholders(bucketed, shards, lambda i: shards[i].shape).items():
        out[i] = x
    return out, forward


def settle(grads: Sequence[torch.Tensor | None], gathers: Gathers) -> list[torch.Tensor | None]:
    """After backward: ``grads`` with the reduce-scatters a bucket's backward left in flight awaited, and
    ``gathers`` closed (a prefetch the loss never used awaited, the kept buckets forgotten)."""
    gathers.close()
    return [fc.dtensor(fc.wait(g._local_tensor), g.device_mesh, g.placements, g)
            if isinstance(g, DTensor) and isinstance(g._local_tensor, funcol.AsyncCollectiveTensor) else g
            for g in grads]


class _Bucket:
    """One bucket's leaves: how to gather them all with one collective (forward, and backward's re-gather)."""

    def __init__(self, at: tuple, placements: tuple, shards: list[DTensor], cast: Any = None):
        self.at, self.placements, self.shards = at, placements, shards
        self.compute = cast.compute if cast is not None else None
        self.reduce = cast.reduce if cast is not None else None
        self.comm = fc.Comm(shards[0].device_mesh, (at[0][0],))
        self.regather: tuple[Regather, int] | None = None  # where its backward re-gather is registered

    def launch(self) -> torch.Tensor:
        blocks = [s.to_local() for s in self.shards]
        if self.compute is not None:  # cast first: the gather moves compute-dtype bytes
            blocks = [b.to(self.compute) for b in blocks]
        return fc.launch_gather(self.comm, blocks, self.at[0])

    def assemble(self, flat: torch.Tensor, shards: Sequence[DTensor] | None = None) -> tuple[DTensor, ...]:
        shards = self.shards if shards is None else shards
        blocks = [s.to_local() for s in shards]
        fulls = fc.assemble(self.comm, flat, blocks, list(self.at))
        return tuple(fc.dtensor(f, self.comm.mesh, pl, s) for f, pl, s in zip(fulls, self.placements, shards))


def _gathered_at(s: DTensor, placements: Sequence[Any]) -> tuple[int, int] | None:
    """``(mesh dim, tensor dim)`` when ``s`` goes to ``placements`` by gathering one plain, even Shard."""
    if not isinstance(s, DTensor):
        return None
    diff = [m for m, (a, b) in enumerate(zip(s.placements, placements)) if a != b]
    if len(diff) != 1:
        return None
    m = diff[0]
    a = s.placements[m]
    if type(a) is not Shard or not isinstance(placements[m], Replicate):
        return None
    if any(isinstance(p, Shard) and p.dim == a.dim for k, p in enumerate(s.placements) if k != m):
        return None  # the dim is split twice: a gather over one mesh dim leaves a strided shard
    # Every split even: a block uneven over another mesh dim (a vocab of 17 over tp=4) has a shape that
    # differs between ranks, which a flat bucket of simulated ranks cannot hold (DTensor gathers it instead).
    even = all(s.shape[p.dim] % s.device_mesh.size(k) == 0 for k, p in enumerate(s.placements) if isinstance(p, Shard))
    return (m, a.dim) if even else None


class _GatherBucket(torch.autograd.Function):
    """Forward: the bucket's blocks all-gathered over their mesh dim. Backward: the gradients reduce-scattered
    (it runs once every leaf's gradient exists, after the last use of the re-gathered weights: freed here)."""

    @staticmethod
    def forward(ctx: Any, bucket: _Bucket, flat: torch.Tensor, *shards: DTensor) -> tuple[DTensor, ...]:
        ctx.bucket = bucket
        # A leaf the loss never uses gets no gradient: ``None`` here, as autograd gives the step
        # (``dtensor_path.grads`` zero-fills it in its storage layout). Materialized, autograd would pass a plain
        # zeros tensor of the leaf's global shape, no DTensor, which has no layout to reduce-scatter in.
        ctx.set_materialize_grads(False)
        return bucket.assemble(flat, shards)

    @staticmethod
    def backward(ctx: Any, *grads: DTensor | None) -> tuple[DTensor | None, ...]:
        bucket = ctx.bucket
        if bucket.regather is not None:  # every use of the re-gathered weights is behind us: free them
            regather, k = bucket.regather
            regather.release(k)
        dm, m = bucket.comm.mesh, bucket.at[0][0]
        out: list[DTensor | None] = [None] * len(grads)
        summed: list[tuple[int, torch.Tensor]] = []  # (leaf, local gradient) Partial(sum) over m
        for k, (g, like) in enumerate(zip(grads, bucket.shards)):
            if g is None:
                continue
            stored = tuple(like.placements)
            other = tuple(stored[j] if j != m else g.placements[m] for j in range(len(stored)))
            g = g if tuple(g.placements) == other else g.redistribute(dm, other)  # other mesh dims as stored
            if isinstance(g.placements[m], Partial) and g.placements[m].reduce_op == "sum":
                local = g.to_local()
                summed.append((k, local.to(bucket.reduce) if bucket.reduce is not None else local))
            else:
                out[k] = g.redistribute(dm, stored)
        if summed:
            blocks, at = [b for _, b in summed], [bucket.at[k] for k, _ in summed]
            flat = fc.launch_reduce(bucket.comm, blocks, at)
            # views of the reduce-scatter in flight (awaited by settle): it overlaps the rest of backward
            for (k, _), local in zip(summed, fc.split_reduced(bucket.comm, flat, blocks, at, awaited=False)):
                out[k] = fc.dtensor(local, dm, bucket.shards[k].placements, bucket.shards[k])
        return (None, None, *out)
