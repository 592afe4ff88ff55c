"""Host memory: copies between the compute device and the host, counted, and activations saved on the host.

Everything that moves memory between the compute device and the host goes through :func:`to_host` and
:func:`to_device`, so one place counts it: each copy tells the listeners (``shardings.comms()`` is one,
while it is active) its direction and bytes (``"d2h"``/``"h2d"``). On a GPU the host copy is pinned and the
copy is ``non_blocking``. On a CPU-only machine host and device are the same memory, and the copies are
still made (a ``clone``): the code path, the bitwise results and the counted bytes are those a GPU run has.

:func:`saved_on_host` is the activation side (JAX's offloading remat policy, torch's ``save_on_cpu``):
inside it, every tensor autograd saves for backward is copied to the host when saved and back to its
device when backward needs it. ``core.remat(fn, policy="offload")`` applies it to ``fn``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["listening", "saved_on_host", "to_device", "to_host"]

_LISTENERS: list[Callable[[str, int], None]] = []


def _notify(kind: str, x: torch.Tensor) -> None:
    nbytes = x.numel() * x.element_size()  # one rank's bytes (a simulated LocalTensor has each rank's shape)
    for listen in _LISTENERS:
        listen(kind, nbytes)


@contextlib.contextmanager
def listening(listen: Callable[[str, int], None]) -> Iterator[None]:
    """Call ``listen(kind, nbytes)`` for every copy made inside the block (``kind``: ``"d2h"`` or ``"h2d"``)."""
    _LISTENERS.append(listen)
    try:
        yield
    finally:
        _LISTENERS.remove(listen)


def to_host(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` in host memory (pinned on a GPU machine), counted as ``d2h``.

    >>> to_host(torch.ones(2)).device
    device(type='cpu')
    """
    x = x.detach()
    if x.device.type == "cpu":
        out = x.clone()  # host and device are one memory: still a copy, as on a GPU
    else:
        out = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True).copy_(x, non_blocking=True)
    _notify("d2h", x)
    return out


def to_device(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A copy of the host tensor ``x`` on ``device``, counted as ``h2d``."""
    x = x.detach()
    out = x.clone() if torch.device(device).type == "cpu" else x.to(device, non_blocking=True)
    _notify("h2d", x)
    return out


@contextlib.contextmanager
def saved_on_host() -> Iterator[None]:
    """Tensors autograd saves inside the block live on the host until backward brings them back.

    >>> w = torch.ones(3, requires_grad=True)
    >>> with saved_on_host():
    ...     y = (w * w).sum()
    >>> y.backward(); w.grad
    tensor([2., 2., 2.])
    """

    def pack(t: torch.Tensor) -> Any:
        return t.device, t.requires_grad, to_host(t)

    def unpack(saved: Any) -> torch.Tensor:
        device, requires_grad, host = saved
        return to_device(host, device).requires_grad_(requires_grad)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
