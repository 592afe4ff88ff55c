"""Which parameters this process holds and updates: all of them, except for pipeline stages on real ranks.

On real processes under ``pp`` a rank materializes only the blocks its stages run (the pipeline plan says which:
:meth:`~shardings.pipeline.Plan.blocks_of`) and the parameters outside the blocks (embedding, final norm,
head); another stage's block is *absent*: a meta-device DTensor of the right shape and layout, holding no
memory (:func:`absent`). Its gradient and optimizer state are absent too, and the update skips it. On simulated
ranks every stage runs in this process, so it holds every leaf, as without ``pp``.

:class:`Ownership` is that answer as data, computed once per step plan (:func:`ownership`; the runtime says
whether ranks are simulated): the mask of leaves held, and what it implies — the parameters outside the blocks
get part of their gradient on the first stage's rank and part on the last's (summed over ``pp``), and a global
norm counts each held block once and the shared leaves once (:func:`global_norm`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import core
from core import tree
from shardings.pipeline import Plan
from shardings.pipeline.execute import in_process
from shardings.runtime.compat import compute_local_shape_and_global_offset
from shardings.spec.errors import sharding_error
from shardings.spec.mesh import Mesh

__all__ = ["Ownership", "absent", "gather_stages", "global_norm", "is_absent", "materialize", "ownership",
           "require_held", "sum_shared"]


def absent(shape: Sequence[int], dtype: torch.dtype, mesh: Mesh, placements: Sequence[Any]) -> DTensor:
    """A DTensor of ``shape`` laid out by ``placements`` whose local block is on the meta device: another pipeline
    stage's block, holding no memory."""
    dm = mesh.device_mesh
    local = compute_local_shape_and_global_offset(torch.Size(shape), dm, placements)[0]
    return DTensor.from_local(torch.empty(local, dtype=dtype, device="meta"), dm, placements, run_check=False,
                              shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())


def is_absent(x: Any) -> bool:
    """Whether ``x`` holds no data (a meta-device tensor or a DTensor whose local block is one)."""
    local = x.to_local() if isinstance(x, DTensor) else x
    return isinstance(local, torch.Tensor) and local.device.type == "meta"


def materialize(x: DTensor, device: torch.device) -> DTensor:
    """An uninitialized real tensor laid out like the absent ``x`` (to receive a broadcast into)."""
    local = torch.empty(x.to_local().shape, dtype=x.dtype, device=device)
    return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())


@dataclasses.dataclass(frozen=True)
class Ownership:
    """Which leaves (by index in flattening order) this process holds.

    Attributes:
        owners: per leaf, the ``pp`` rank holding it, or ``None`` where every rank does (outside the blocks);
            empty when this process holds every leaf (no ``pp``, or simulated ranks).
        rank: this process's ``pp`` rank.
        group: the ``pp`` process group (the shared leaves' gradients and the global norm are summed over it).
    """

    owners: tuple[int | None, ...] = ()
    rank: int = 0
    group: Any = None

    @property
    def whole(self) -> bool:
        """Whether this process holds every leaf."""
        return not self.owners

    def held(self, n: int) -> list[int]:
        """The indices of the leaves held, of ``n``."""
        return list(range(n)) if self.whole else [i for i, o in enumerate(self.owners) if o is None or o == self.rank]

    def shared(self) -> list[int]:
        """Leaves every rank holds whose gradient each stage has a part of (summed over ``pp``): none when whole."""
        return [i for i, o in enumerate(self.owners) if o is None]

    def counted(self) -> list[int]:
        """Leaves this rank adds to a global norm: its blocks, and the shared ones on rank 0 only."""
        return [i for i, o in enumerate(self.owners) if o == self.rank or (o is None and self.rank == 0)]


WHOLE = Ownership()


def ownership(plan: Plan | None, params: Any, mesh: Mesh) -> Ownership:
    """This process's leaves of ``params`` (or of a tree shaped like them) under a pipeline ``plan`` on ``mesh``
    (the whole mesh, with its ``pp`` axis): every leaf without a plan, with one pipeline rank, or on simulated ranks."""
    if plan is None or in_process(plan.pp):
        return WHOLE
    dm = mesh.device_mesh
    return Ownership(tuple(plan.owners(params)), dm.get_local_rank("pp"), dm.get_group("pp"))


def require_held(params: Any, own: Ownership, mesh: Mesh) -> None:
    """Raise unless every leaf this process holds is materialized (``init`` and the step split the same way)."""
    leaves = tree.leaves(params)
    missing = [i for i in own.held(len(leaves)) if is_absent(leaves[i])]
    if missing:
        path = tree.keystr(tree.leaves_with_path(params)[missing[0]][0])
        raise sharding_error(f"this rank's stage runs {path}, but shardings.init left it absent (another stage's "
                             "block): init and train_step split the blocks differently",
                             fix="pass the same plan (or stage_sizes) to shardings.init and train_step", mesh=mesh)


def global_norm(own: Ownership, grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The global gradient norm when stages hold different leaves: each rank's blocks and the shared leaves once
    (on rank 0), one scalar all-reduce over ``pp``."""
    mine = [grads[i] for i in own.counted()]
    sq = core.optim.global_norm(mine) ** 2 if mine else torch.zeros(())
    sq = (sq.full_tensor() if isinstance(sq, DTensor) else sq).detach().clone()
    dist.all_reduce(sq, group=own.group)
    return sq.sqrt()


def sum_shared(own: Ownership, grads: Sequence[torch.Tensor]) -> None:
    """Sum the shared leaves' gradients over ``pp`` in place: the first and the last stage each computed part
    (a tied embedding's gradient from the head is a transposed view)."""
    for i in own.shared():
        x = grads[i].to_local() if isinstance(grads[i], DTensor) else grads[i]
        buf = x if x.is_contiguous() else x.contiguous()
        dist.all_reduce(buf, group=own.group)
        if buf is not x:
            x.copy_(buf)


def gather_stages(own: Ownership, params: Any, device: str) -> Any:
    """Every block as its owner holds it (a broadcast over ``pp`` per leaf; an absent one becomes a real tensor
    first); ``params`` themselves where this process holds every leaf."""
    if own.whole:
        return params
    out = []
    for x, owner in zip(tree.leaves(params), own.owners):
        if owner is not None:
            x = materialize(x, torch.device(device)) if is_absent(x) else x
            local = x.to_local() if isinstance(x, DTensor) else x
            dist.broadcast(local, src=dist.get_global_rank(own.group, owner), group=own.group)
        out.append(x)
    return tree.unflatten(tree.structure(params), out)
