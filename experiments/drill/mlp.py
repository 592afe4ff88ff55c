"""``models.mlp`` with the drill's fault fields (``model.name=experiments.drill.mlp``); see :mod:`.faults`."""

from __future__ import annotations

import dataclasses
from typing import Any

from experiments.drill.faults import Faults, wrap
from models import mlp


@dataclasses.dataclass(frozen=True)
class Config(mlp.Config, Faults):
    """``mlp.Config`` plus :class:`Faults`."""


init, loss, stages = wrap(mlp)


def __getattr__(name: str) -> Any:
    return getattr(mlp, name)  # axes, example_batch, ...: mlp's own
