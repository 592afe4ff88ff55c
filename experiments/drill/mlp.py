"""``models.mlp`` with the drill's fault fields (``model.name=experiments.drill.mlp``); see :mod:`.faults`."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from experiments.drill.faults import Faults, arm
from models import mlp


@dataclasses.dataclass(frozen=True)
class Config(mlp.Config, Faults):
    """``mlp.Config`` plus :class:`Faults`."""


def init(key: torch.Tensor, cfg: Config) -> dict[str, Any]:
    """``mlp.init``, once the rank is armed."""
    arm(cfg)
    return mlp.init(key, cfg)


def __getattr__(name: str) -> Any:
    return getattr(mlp, name)  # axes, loss, stages, example_batch, ...: mlp's own
