"""Learning-rate schedules: functions ``count -> value`` built from tensor ops only.

``count`` is the optimizer's step counter (a 0-d int tensor; a Python int also works) and the
value is a 0-d float32 tensor. No branch looks at the count's value, so schedules trace under
``torch.compile`` and work when the counter is a replicated DTensor.
"""

from __future__ import annotations

import math

import torch

from core.optim.base import Schedule, optim_error

__all__ = ["constant", "linear", "warmup_cosine"]


def _steps(count: torch.Tensor | int) -> torch.Tensor:
    return torch.as_tensor(count).to(torch.float32)


def constant(value: float) -> Schedule:
    """``value`` at every step.

    >>> constant(0.1)(7)
    tensor(0.1000)
    """
    return lambda count: torch.zeros_like(_steps(count)) + value


def linear(init: float, end: float, steps: int) -> Schedule:
    """Linear from ``init`` at count 0 to ``end`` at count ``steps``, then ``end``.

    ``value(c) = init + (end - init) * min(c / steps, 1)``, as optax's ``linear_schedule``.

    Raises:
        ValueError: ``steps`` not a positive int.

    >>> linear(1.0, 0.0, 4)(1)
    tensor(0.7500)
    """
    _check_steps("linear: steps", steps, minimum=1)
    return lambda count: init + (end - init) * (_steps(count) / steps).clamp(0.0, 1.0)


def warmup_cosine(peak: float, warmup_steps: int, decay_steps: int, end: float = 0.0, init: float = 0.0) -> Schedule:
    """Linear warmup then cosine decay, as optax's ``warmup_cosine_decay_schedule``.

    With ``W = warmup_steps`` and ``T = decay_steps - W`` (``decay_steps`` *includes* the warmup)::

        c < W:          init + (peak - init) * c / W
        W <= c:         end + (peak - end) * (1 + cos(pi * min(c - W, T) / T)) / 2

    So the value is ``init`` at 0, ``peak`` at ``W``, ``end`` at ``decay_steps`` and after.

    Args:
        peak: the value at the end of warmup.
        warmup_steps: steps of linear warmup (0: start at ``peak``).
        decay_steps: total steps of warmup plus decay.
        end: the final value.
        init: the value at count 0.

    Raises:
        ValueError: ``warmup_steps < 0`` or ``decay_steps <= warmup_steps``.

    >>> lr = warmup_cosine(1.0, warmup_steps=2, decay_steps=6)
    >>> [round(lr(c).item(), 3) for c in (0, 1, 2, 4, 6, 9)]
    [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    _check_steps("warmup_cosine: warmup_steps", warmup_steps, minimum=0)
    _check_steps("warmup_cosine: decay_steps", decay_steps, minimum=warmup_steps + 1)
    decay_len = decay_steps - warmup_steps

    def schedule(count: torch.Tensor | int) -> torch.Tensor:
        c = _steps(count)
        warm = init + (peak - init) * c / max(warmup_steps, 1)
        frac = ((c - warmup_steps) / decay_len).clamp(0.0, 1.0)
        decay = end + (peak - end) * 0.5 * (1 + torch.cos(math.pi * frac))
        return torch.where(c < warmup_steps, warm, decay)

    return schedule


def _check_steps(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise optim_error(f"{name} must be an int >= {minimum}, got {value!r}", f"pass an int >= {minimum}")
