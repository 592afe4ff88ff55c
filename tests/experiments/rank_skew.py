"""A deliberately rank-dependent model: ``models.mlp`` whose ``unembed`` gradient depends on the rank.

For the equivalence CLI's failure path (``model.name=tests.experiments.rank_skew``). The forward
pass is exactly mlp's; in backward, rank ``r`` scales its ``unembed`` gradient by ``1 + r/10``
(``rank_map`` gives one factor per simulated rank, or this process's under real ranks). Rank 0,
and the single-device reference (plain tensors), see a factor 1, so loss and every other gradient
agree and only ``['unembed']`` differs — the key path the CLI must name.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from models import mlp
from models.mlp import Config, axes, example_batch, init
from shardings.runtime.compat import rank_map

__all__ = ["Config", "apply", "axes", "example_batch", "init", "loss"]


def _skew_grad(w: torch.Tensor) -> torch.Tensor:
    if not isinstance(w, DTensor):
        return w
    local = w.to_local()
    factor = rank_map(lambda r: torch.tensor(1.0 + r / 10))
    skewed = local + (factor - 1) * (local - local.detach())  # value: local; gradient: factor × gradient
    return DTensor.from_local(skewed, w.device_mesh, w.placements, run_check=False, shape=w.shape, stride=w.stride())


def apply(params: dict, tokens: torch.Tensor, cfg: Config) -> torch.Tensor:
    """mlp's logits, with the rank-dependent ``unembed`` gradient."""
    return mlp.apply({**params, "unembed": _skew_grad(params["unembed"])}, tokens, cfg)


def loss(params: dict, batch: dict[str, torch.Tensor], cfg: Config) -> torch.Tensor:
    """mlp's loss, with the rank-dependent ``unembed`` gradient."""
    return mlp.loss({**params, "unembed": _skew_grad(params["unembed"])}, batch, cfg)
