"""The batch of a train step: placed by the layout's ``batch`` rules, split into microbatches."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from core import tree
from shardings.runtime.simulate import per_rank
from shardings.spec import lower
from shardings.spec.distribute import shard
from shardings.spec.errors import ShardingError, sharding_error
from shardings.spec.mesh import Mesh
from shardings.spec.rules import logical_to_spec

__all__ = ["check_batch_rows", "default_token_count", "place", "split"]


def default_token_count(batch: Any, ignore_index: int = -100) -> torch.Tensor:
    """Tokens a batch contributes to the loss: labels ≠ ``ignore_index``, else the leading dim of the first leaf."""
    if isinstance(batch, dict) and "labels" in batch:
        return (batch["labels"] != ignore_index).sum()
    first = tree.leaves(batch)[0]
    return torch.ones((), dtype=torch.int64) * first.shape[0]


def check_batch_rows(rows: int, data_ranks: int, microbatches: int = 1, *, per: str = "accumulation steps",
                     setting: str = "the global batch size", cls: type[Exception] = ShardingError,
                     **where: Any) -> None:
    """The one check that a global batch splits evenly: ``rows`` a positive multiple of data-parallel ranks ×
    microbatches. ``experiments.build`` (the config), ``experiments.data`` (the sharded batch) and :func:`place`
    (the step) all call it.

    Args:
        rows: the global batch size.
        data_ranks: the ranks the batch dim is split over.
        microbatches: each rank's rows are split this many ways (accumulation, or the pipeline's microbatches).
        per: what the microbatches are, for the message.
        setting: what the user sets, for the fix.
        cls: the error class (``experiments``: its ``ConfigError``).
        **where: ``path``/``spec``/``mesh``/``shape`` for :func:`~shardings.spec.errors.sharding_error`.

    Raises:
        ShardingError: (or ``cls``) the rows do not split evenly.
    """
    parts = data_ranks * microbatches
    if rows < 1 or rows % parts:
        why = f"{data_ranks} data-parallel ranks" + (f" × {microbatches} {per}" if microbatches > 1 else "")
        raise sharding_error(f"batch size={rows} is not divisible by {parts} ({why})",
                             fix=f"set {setting} to a multiple of {parts}", cls=cls, **where)


def place(batch: Any, layout: Any, mesh: Mesh, accum_steps: int) -> Any:
    """Every leaf of the global ``batch`` placed by the layout's ``batch`` rules (names ``("batch", "seq")``).

    Raises:
        ShardingError: a batch size that is not a multiple of data-parallel ranks × ``accum_steps``, or a
            batch whose values differ between simulated ranks; naming the leaf, the spec and the mesh.
    """
    rules = layout.role("batch")

    def place(path, x):
        names = ("batch", "seq", *([None] * (x.ndim - 2)))[: x.ndim]
        spec = logical_to_spec(names, rules, mesh, path=path)
        check_batch_rows(x.shape[0] if x.ndim else 0, mesh.axis_size(spec.dim_axes()[0] if x.ndim else None),
                         accum_steps, path=path, spec=spec, shape=x.shape, mesh=mesh)
        if isinstance(x, DTensor):
            return x.redistribute(mesh.device_mesh, lower.to_placements(spec, mesh, x.ndim))
        ranks = per_rank(x)
        if any(r.shape != ranks[0].shape or not torch.equal(r, ranks[0]) for r in ranks[1:]):
            raise sharding_error(
                "the batch holds different values on different simulated ranks (a random op inside "
                "shardings.simulate() draws its own stream on each rank), so it is not one global batch",
                fix="build the batch before entering shardings.simulate()", path=path, spec=spec, mesh=mesh,
            )
        return shard(x, spec, mesh)

    return tree.map_with_path(place, batch)


def split(batch: Any, k: int) -> list[Any]:
    """The placed ``batch`` as ``k`` microbatches: each rank splits its own rows (no data moves)."""
    if k == 1:
        return [batch]

    def parts_of(x: DTensor) -> list[DTensor]:
        # Each rank splits its own rows, so microbatching never moves data between ranks.
        shape = (x.shape[0] // k, *x.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        return [
            DTensor.from_local(part, x.device_mesh, x.placements, run_check=False, shape=shape, stride=stride)
            for part in x.to_local().chunk(k)
        ]

    leaves, treedef = tree.flatten(batch)
    parts = [parts_of(x) for x in leaves]
    return [tree.unflatten(treedef, [p[i] for p in parts]) for i in range(k)]
