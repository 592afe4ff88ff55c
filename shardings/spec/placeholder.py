"""A tensor that stands for another not yet materialized, and :func:`resolve`.

``constrain`` and ``shard_map`` branch on a tensor's type before operating on it, so a ZeRO-3
placeholder (:class:`shardings.residency.lazy_params.Lazy`) must become its real tensor first. The
protocol lives here, in the language, and residency implements it: the language does not import
the layer above it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Placeholder", "resolve"]


class Placeholder(torch.Tensor):
    """A tensor subclass whose data arrives on :meth:`materialize` (implemented by a subclass)."""

    def materialize(self) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement materialize()")


def resolve(x: Any) -> Any:
    """``x``, or the real tensor when it is a placeholder: for code that inspects a tensor's type
    (``isinstance(x, DTensor)``) before any operation would materialize it."""
    return x.materialize() if isinstance(x, Placeholder) else x
