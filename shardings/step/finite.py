"""A step without a loss scale whose gradients are not finite raises :class:`NonFiniteGradError`, naming the first
leaf whose gradient holds a NaN or an inf.

The check costs nothing on a good step: the ``grad_norm`` metric is already the reduced global norm, and it is
finite exactly when every gradient on every rank is. Only on the failure path does each leaf, in key-path order,
get one all-reduce of a flag (``mixed.finite``) until the first bad one, so every rank names the same leaf.
(With a loss scale, fp16, such a step is skipped and counted instead: ``TrainStep.apply``.)
"""

from __future__ import annotations

import math
from typing import Any

from core import tree
from shardings.step import mixed

__all__ = ["NonFiniteGradError", "check"]


class NonFiniteGradError(FloatingPointError):
    """A step's gradients hold a NaN or an inf; ``path`` is the first leaf's key path, ``step`` the step if known."""

    __module__ = "shardings"

    def __init__(self, path: str, norm: float, step: int | None = None):
        self.path, self.norm, self.step = path, norm, step
        at = f"at step {step}: " if step is not None else ""
        super().__init__(
            f"{at}the gradient of {path} is not finite (NaN or inf; the global gradient norm is {norm}). "
            "Fix: look at this step's batch and the loss (a log of 0, a division, an fp16 overflow: precision=bf16, "
            "or fp16 with its loss scale, which skips such steps), then resume from the last checkpoint")

    def at_step(self, step: int) -> NonFiniteGradError:
        """The same error, naming ``step``."""
        return NonFiniteGradError(self.path, self.norm, step)


def check(mesh: Any, grads: Any, norm: float) -> None:
    """Raise :class:`NonFiniteGradError` when ``norm`` (the reduced global gradient norm) is not finite."""
    if math.isfinite(norm):
        return
    for path, g in tree.flatten_with_path(grads)[0]:
        if not mixed.finite(mesh, [g]):  # one all-reduce per leaf, every rank in the same order
            raise NonFiniteGradError(tree.keystr(path), norm)
    raise NonFiniteGradError("no single leaf (each is finite: their norm overflowed)", norm)
