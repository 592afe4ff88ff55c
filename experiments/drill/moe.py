"""``models.moe`` with the drill's fault fields (``model.name=experiments.drill.moe``); see :mod:`.faults`."""

from __future__ import annotations

import dataclasses
from typing import Any

from experiments.drill.faults import Faults, wrap
from models import moe


@dataclasses.dataclass(frozen=True)
class Config(moe.Config, Faults):
    """``moe.Config`` plus :class:`Faults`."""


init, loss, stages = wrap(moe)


def __getattr__(name: str) -> Any:
    return getattr(moe, name)  # axes, example_batch, ...: moe's own
