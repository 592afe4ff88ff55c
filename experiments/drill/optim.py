"""``adamw`` with the drill's ``kill_optimizer`` fault (``optim.name=experiments.drill.optim``; see :mod:`.faults`).

On the armed fault's rank, the update of step ``fault_step`` SIGKILLs its process once the new moments are
computed (``update``) or once torch's fused kernel has written the new params and moments in place
(``fused_step``): the rank dies inside the optimizer, its peers in the step's next collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from core import optim
from experiments.drill.faults import IN_OPTIMIZER, armed, kill


def _count(state: Any) -> int | None:
    """The updates applied so far: the first ``count`` in the optimizer state (Adam's)."""
    count = getattr(state, "count", None)  # a NamedTuple's field (a plain tuple's .count is a method)
    if isinstance(count, torch.Tensor):
        return int(count.to_local() if isinstance(count, DTensor) else count)
    for sub in state if isinstance(state, (tuple, list)) else ():
        found = _count(sub)
        if found is not None:
            return found
    return None


def _strikes(state: Any) -> bool:
    cfg = armed()
    return (cfg is not None and cfg.fault in IN_OPTIMIZER and dist.get_rank() == cfg.fault_rank
            and _count(state) == cfg.fault_step - 1)


def optimizer(conf: Any, lr: Any) -> optim.GradientTransformation:
    """``core.optim.adamw`` of the ``optim`` node ``conf``, its ``update`` and ``fused_step`` planted."""
    inner = optim.adamw(lr, b1=conf.b1, b2=conf.b2, weight_decay=conf.weight_decay)

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        strikes = _strikes(state)
        out = inner.update(updates, state, params)
        if strikes:
            kill(armed(), "optimizer update")
        return out

    def fused_step(grads: Any, state: Any, params: Any) -> Any:
        strikes = _strikes(state)
        out = inner.fused_step(grads, state, params)
        if strikes:
            kill(armed(), "optimizer update (fused, params written in place)")
        return out

    return inner._replace(update=update, fused_step=fused_step if inner.fused_step is not None else None)
