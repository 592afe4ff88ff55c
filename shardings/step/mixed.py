"""A ``core.precision.Policy`` inside the train step: which dtype each tensor is in when it moves.

- **Storage and update** in ``param_dtype`` (the fp32 master weights); the optimizer sees ``param_dtype``
  gradients and parameters.
- **Master weights with the optimizer state** (ZeRO-1/2, as the ZeRO paper and DeepSpeed): where the optimizer
  state is split over ranks that store the params whole, and the compute dtype is narrower than the params',
  the fp32 master becomes part of the optimizer state (:class:`Master`, sharded with Adam's moments) and the
  stored params are the compute-dtype copy: zero1 holds 4P+12P/N, zero2 2P+14P/N. The update runs on the
  master shard; the all-gather after it moves compute-dtype bytes (:func:`keeps_master` decides, once per plan).
- **Compute**: each rank casts its *own blocks* to ``compute_dtype`` before anything is gathered, so a
  ZeRO-3 all-gather moves compute-dtype bytes (half of fp32's in bf16), as FSDP2's ``param_dtype``.
- **Reduction and accumulation** in ``reduce_dtype``: a gradient leaves backward in compute dtype, is cast to
  ``reduce_dtype`` before its reduce-scatter or all-reduce, is summed over microbatches in it, and is cast
  to ``param_dtype`` once reduced (FSDP2's ``reduce_dtype``).
- **fp16 loss scaling** (``Policy.scaler``): the loss is multiplied by the scale before backward; the
  reduced gradients are divided by it before clipping; :func:`finite` asks every rank, with one
  all-reduce of a flag, whether any gradient holds an inf or NaN (the step is then skipped).

:class:`Cast` is what the execution paths (``local_step``, ``gather_buckets``) are handed: two dtypes, or
``None`` for "leave as is".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardings.comm import flat_comm as fc
from shardings.runtime.compat import funcol

__all__ = ["Cast", "Master", "Scaled", "finite", "keeps_master", "unscale"]


class Scaled(NamedTuple):
    """The train step's optimizer state under a loss scale: the scale's state and the optimizer's."""

    loss_scale: Any  # core.precision.LossScaleState
    opt: Any


class Master(NamedTuple):
    """The train step's optimizer state when it keeps the master weights (:func:`keeps_master`): the master
    weights in ``param_dtype``, laid out like the optimizer state, and the optimizer's own state."""

    weights: Any  # the params' tree: fp32 master, in the opt_state placements
    opt: Any


def keeps_master(cast: Cast, params: Sequence[torch.Tensor], placements: dict[str, list], mesh: Any) -> bool:
    """Whether the optimizer state holds the master weights (ZeRO-1/2 under a policy, module docstring): a compute
    dtype other than some floating parameter's, and the optimizer state split over a mesh axis (of size > 1)
    where the stored params are not."""
    if cast.compute is None or not any(p.is_floating_point() and p.dtype != cast.compute for p in params):
        return False
    sizes = [mesh.axis_size(a) for a in mesh.device_axes]
    return any(o != s and n > 1 for opt, st in zip(placements["opt_state"], placements["params"])
               for o, s, n in zip(opt, st, sizes))


class Cast(NamedTuple):
    """Compute and reduce dtypes of a policy (``None``: no cast).

    >>> Cast.of(Policy.bf16_mixed()).compute
    torch.bfloat16
    """

    compute: torch.dtype | None = None
    reduce: torch.dtype | None = None

    @classmethod
    def of(cls, policy: Any) -> Cast:
        """The casts of a ``core.precision.Policy`` (``None``: none)."""
        return cls() if policy is None else cls(policy.compute_dtype, policy.reduce_dtype)

    def to_compute(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` in compute dtype (floating tensors only; differentiable)."""
        return x.to(self.compute) if self.compute is not None and x.is_floating_point() else x

    def to_reduce(self, g: torch.Tensor) -> torch.Tensor:
        """A gradient in reduce dtype, for its collective and its accumulation."""
        return g.to(self.reduce) if self.reduce is not None and g.is_floating_point() else g


def unscale(grads: Sequence[torch.Tensor], scale: torch.Tensor) -> list[torch.Tensor]:
    """Gradients divided by the loss scale (on each rank's blocks; placements kept)."""
    inv = 1.0 / float(scale)
    return [g * inv for g in grads]


def finite(mesh: Any, grads: Sequence[torch.Tensor]) -> bool:
    """Whether every gradient on every rank is finite: one all-reduce (max) of a flag over the whole world.

    A rank that sees an inf or NaN in any of its blocks votes 1; the step is skipped everywhere if anyone
    did, so sharded gradients (tp, ZeRO) whose bad block lives on one rank still skip on all.
    """
    blocks = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    blocks = [b for b in blocks if b.device.type != "meta"]  # another pipeline stage's (absent here)
    bad = torch.zeros((), dtype=torch.float32)
    if blocks:
        # sum of (x * 0) is NaN exactly when some x is inf or NaN; one foreach pass per dtype
        bad = torch.stack([torch.sum(b * 0) for b in blocks]).sum().float()
    flag = torch.where(torch.isnan(bad), 1.0, 0.0)
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = fc.wait(funcol.all_reduce(flag, "max", dist.group.WORLD))
    from shardings.runtime.simulate import unwrap

    return float(unwrap(flag)) == 0.0
