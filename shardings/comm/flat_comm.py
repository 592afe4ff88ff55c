"""Collectives on flat buffers: many leaves packed into one tensor, moved by one collective, split back.

The pieces the local train step (:mod:`shardings.step.local_step`) and the DTensor path's bucketed
ZeRO-3 gathers (:mod:`shardings.residency.gather_buckets`) share. A leaf split over a mesh dim is described
by ``at = (mesh dim, tensor dim)``; ``None`` means replicated. All ops work on local tensors (plain,
or ``LocalTensor`` under :func:`shardings.simulate`); launches are asynchronous and :func:`wait`
resolves them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from shardings.runtime.compat import (
    DTensorSpec,
    TensorMeta,
    all_gather_single,
    enabled_local_tensor_mode,
    funcol,
    pytree,
    reduce_scatter_single,
)

__all__ = ["Comm", "ShardAt", "assemble", "buckets", "dtensor", "from_block", "launch_gather", "launch_reduce",
           "split_reduced", "unit_buckets", "unit_of", "wait"]

ShardAt = tuple[int, int] | None  # (device-mesh dim, tensor dim) a leaf is split on, or None: replicated
Buckets = tuple[tuple[int, ...], ...]  # leaf indices, bucket by bucket


def unit_of(path: Sequence[Any]) -> tuple:
    """The gather unit of a leaf at ``path``: the path through its first list index (one transformer
    block, ``blocks/3``: FSDP's per-block wrapping), or ``()`` for the leaves outside any list (the root).

    >>> unit_of(tree.leaves_with_path(params)[0][0])  # doctest: +SKIP
    (MappingKey(key='blocks'), SequenceKey(idx=0))
    """
    for k, entry in enumerate(path):
        if isinstance(entry, pytree.SequenceKey):
            return tuple(path[: k + 1])
    return ()


def unit_buckets(order: list[int], params: Sequence[torch.Tensor], key: Callable[[int], tuple],
                 bucket_mb: float | None, units: Sequence[tuple] | None) -> tuple[Buckets, tuple[int, ...]]:
    """ZeRO-3's gather buckets: :func:`buckets` that never mix two ``units`` (per leaf, :func:`unit_of`),
    and which of them stay gathered from forward to backward instead of being gathered again: the
    root unit's, in a model that has blocks, as FSDP2 keeps its root module's (the embedding, final
    norm and unembedding: used first and last, so a backward re-gather would free nothing for long).
    """
    unit = (lambda i: units[i]) if units is not None else (lambda i: None)
    out = buckets(order, params, lambda i: (*key(i), unit(i)), bucket_mb)
    has_blocks = any(unit(i) not in ((), None) for i in order)
    return out, tuple(k for k, b in enumerate(out) if has_blocks and unit(b[0]) == ())


def buckets(order: list[int], params: Sequence[torch.Tensor], key: Callable, bucket_mb: float | None) -> Buckets:
    """``order``'s leaves in runs of at most ``bucket_mb`` MB per ``key`` (a leaf larger than the cap alone)."""
    cap = (bucket_mb or 0) * 1e6
    out: list[list[int]] = []
    open_: dict[Any, tuple[list[int], list[int]]] = {}  # key -> (leaves, [bytes])
    for i in order:
        nbytes = params[i].numel() * params[i].element_size()
        cur = open_.get(key(i))
        if cur is None or cur[1][0] + nbytes > cap:
            cur = open_[key(i)] = ([], [0])
            out.append(cur[0])
        cur[0].append(i)
        cur[1][0] += nbytes
    return tuple(tuple(b) for b in out)


def dtensor(local: torch.Tensor, dm: Any, placements: Sequence[Any], like: torch.Tensor) -> DTensor:
    """``DTensor.from_local(local, dm, placements, shape=like.shape, stride=like.stride())`` without its
    autograd node and argument checks (~0.15 ms each, for every param, grad and state leaf per step):
    the plan already knows the layout is consistent. Also for use inside an autograd function."""
    return from_block(local, dm, placements, like.shape, like.stride())


def from_block(local: torch.Tensor, dm: Any, placements: Sequence[Any], shape: Sequence[int],
               stride: Sequence[int]) -> DTensor:
    """:func:`dtensor` given the global ``shape`` and ``stride``."""
    spec = _spec(dm, id(dm), tuple(placements), torch.Size(shape), tuple(stride), local.dtype)
    return DTensor(local, spec, requires_grad=False)


@functools.lru_cache(maxsize=4096)
def _spec(dm: Any, dm_id: int, placements: tuple[Any, ...], shape: torch.Size, stride: tuple[int, ...],
          dtype: Any) -> DTensorSpec:
    # Shared, never mutated: building a spec (its shard order and hash bookkeeping) costs more than the
    # small ops it describes, and a step rebuilds the same few hundred layouts. Keyed by the DeviceMesh
    # object too: an equal one of an earlier runtime (a torn-down simulate()) must not hand out its specs.
    return DTensorSpec(dm, placements, tensor_meta=TensorMeta(shape, stride, dtype))


def wait(x: torch.Tensor) -> torch.Tensor:
    return x.wait() if isinstance(x, funcol.AsyncCollectiveTensor) else x


class Comm(NamedTuple):
    mesh: Any  # DeviceMesh
    data_dims: tuple[int, ...]

    def group(self, m: int):
        return self.mesh.get_group(m)

    def size(self, m: int) -> int:
        return self.mesh.size(m)


def launch_gather(comm: Comm, shards: list[torch.Tensor], at: tuple[int, int]) -> torch.Tensor:
    """All-gather the ``shards``, flattened: ``(n·L,)``, awaited on first use (or by :func:`wait`)."""
    group, flat = comm.group(at[0]), [s.reshape(-1) for s in shards]
    if enabled_local_tensor_mode() is not None:  # simulated ranks gather at once: no input outlives the call
        return all_gather_single(torch.cat(flat), 0, group)
    # In place, as FSDP2: this rank's shards are copied into its slice of the output, which is the input.
    # A separate input would stay alive while the gather is in flight (a prefetch: until the next block).
    n, size = group.size(), sum(f.numel() for f in flat)
    out = flat[0].new_empty(n * size)
    mine = torch.cat(flat, out=out.narrow(0, group.rank() * size, size))
    return funcol._maybe_wrap_tensor(
        torch.ops._c10d_functional.all_gather_into_tensor_out(mine, n, group.group_name, out=out))


def assemble(comm: Comm, gathered: torch.Tensor, shards: list[torch.Tensor], at: list) -> list[torch.Tensor]:
    n = comm.size(at[0][0])
    rows = wait(gathered).view(n, -1)  # (ranks, L): rank r's flat shards
    pieces = rows.split([s.numel() for s in shards], dim=1)
    # Shard(0): rank blocks stack in order; Shard(d): each rank's block is put back along d.
    return [torch.cat([q.view(s.shape) for q in p.unbind(0)], dim=a[1]) if a[1]
            else p.reshape(n * s.shape[0], *s.shape[1:]) for p, s, a in zip(pieces, shards, at)]


def launch_reduce(comm: Comm, grads: list[torch.Tensor], target: list[ShardAt]) -> torch.Tensor:
    """Sum ``grads`` over the data dims into their target layout; returns the flat local result (async)."""
    rs = target[0][0] if target[0] is not None else None
    if rs is None:
        flat = torch.cat([g.reshape(-1) for g in grads])
    else:  # rank r's chunks of every leaf, then rank r+1's: reduce-scatter leaves rank r with its chunks
        n = comm.size(rs)
        chunks = [g.chunk(n, dim=t[1]) for g, t in zip(grads, target)]
        flat = torch.cat([c[r].reshape(-1) for r in range(n) for c in chunks])
        flat = reduce_scatter_single(flat, "sum", 0, comm.group(rs))
    for m in comm.data_dims:
        if m != rs and comm.size(m) > 1:  # in place: ``flat`` is this function's own buffer (funcol's copies)
            flat = funcol._maybe_wrap_tensor(
                torch.ops._c10d_functional.all_reduce_(wait(flat), "sum", comm.group(m).group_name))
    return flat


def split_reduced(comm: Comm, flat: torch.Tensor, like: list[torch.Tensor], target: list[ShardAt],
                  awaited: bool = True) -> list[torch.Tensor]:
    """``flat`` (from :func:`launch_reduce`) split into the leaves' reduced blocks; with ``awaited=False``
    they are views of the collective still in flight, awaited on first use (or by :func:`wait`)."""
    shapes = [g.chunk(comm.size(t[0]), dim=t[1])[0].shape if t else g.shape for g, t in zip(like, target)]
    flat = wait(flat) if awaited else flat
    return [p.view(s) for p, s in zip(flat.split([math.prod(s) for s in shapes]), shapes)]
