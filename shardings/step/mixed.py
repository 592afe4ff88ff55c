"""A ``core.precision.Policy`` inside the train step: which dtype each tensor is in when it moves.

- **Storage and update** in ``param_dtype`` (the fp32 master weights); the optimizer sees ``param_dtype``
  gradients and parameters.
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

__all__ = ["Cast", "Scaled", "finite", "unscale"]


class Scaled(NamedTuple):
    """The train step's optimizer state under a loss scale: the scale's state and the optimizer's."""

    loss_scale: Any  # core.precision.LossScaleState
    opt: Any


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
