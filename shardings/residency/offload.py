"""Roles in host memory (``Layout.host``): trees of (D)Tensors copied to the host and back, counted.

``offload_optimizer`` keeps the optimizer state on the host between steps and runs the update there, as
ZeRO-Offload: each step the rank's reduced gradient blocks and its parameter blocks (in the optimizer-state
layout) go device→host, the elementwise optimizer updates them on the host (torch's fused CPU kernel for
``adamw``), and the new parameter blocks go host→device. There is no host master copy of the params (ZeRO-
Offload keeps one): the parameter blocks travel both ways, one param-sized ``d2h`` more per step than it.

``offload_params`` keeps the parameters on the host between steps: the step copies them to the device
first and the new ones back after the update.

Every copy is :mod:`core.offload`'s (pinned, ``non_blocking`` on a GPU; a real copy on a CPU-only machine),
so ``shardings.comms()`` counts each as a ``d2h``/``h2d`` row of the bytes moved.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from core import offload, tree
from shardings.comm import flat_comm as fc

__all__ = ["to_device", "to_host"]


def _move(x: Any, copy) -> Any:
    if isinstance(x, DTensor):
        return fc.dtensor(copy(x.to_local()), x.device_mesh, x.placements, x)
    return copy(x) if isinstance(x, torch.Tensor) else x


def to_host(t: Any) -> Any:
    """Every tensor leaf of ``t`` copied to host memory (a DTensor keeps its mesh and placements)."""
    return tree.map(lambda x: _move(x, offload.to_host), t)


def to_device(t: Any, device: torch.device | str) -> Any:
    """Every tensor leaf of the host tree ``t`` copied to ``device``."""
    return tree.map(lambda x: _move(x, lambda v: offload.to_device(v, device)), t)
