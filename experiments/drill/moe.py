"""``models.moe`` with the drill's fault fields (``model.name=experiments.drill.moe``); see :mod:`.faults`."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from experiments.drill.faults import Faults, arm
from models import moe


@dataclasses.dataclass(frozen=True)
class Config(moe.Config, Faults):
    """``moe.Config`` plus :class:`Faults`."""


def init(key: torch.Tensor, cfg: Config) -> dict[str, Any]:
    """``moe.init``, once the rank is armed."""
    arm(cfg)
    return moe.init(key, cfg)


def __getattr__(name: str) -> Any:
    return getattr(moe, name)  # axes, loss, example_batch, ...: moe's own
