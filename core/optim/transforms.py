"""Building blocks: one idea per transformation, composed with :func:`~core.optim.base.chain`.

Formulas follow ``torch.optim`` (SGD, AdamW, ``clip_grad_norm_``) so that the aliases in
``core.optim.aliases`` reproduce them to float rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from core import tree
from core.optim.base import (
    EmptyState,
    GradientTransformation,
    PyTree,
    ScalarOrSchedule,
    Schedule,
    global_norm,
    optim_error,
    zero_count,
    zeros_like_params,
)
from core.optim.foreach import columns

__all__ = [
    "ScaleByAdamState",
    "ScaleByScheduleState",
    "TraceState",
    "add_decayed_weights",
    "clip_by_global_norm",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "trace",
]

MaskOrFn = PyTree | Callable[[PyTree], PyTree] | None


class ScaleByScheduleState(NamedTuple):
    count: torch.Tensor  # 0-d int32: updates applied so far


class TraceState(NamedTuple):
    trace: PyTree  # momentum buffer, like params


class ScaleByAdamState(NamedTuple):
    count: torch.Tensor  # 0-d int32: updates applied so far
    mu: PyTree  # first moment, like params
    nu: PyTree  # second moment, like params


def _stateless(fn: Callable[[PyTree, PyTree], PyTree], elementwise: bool = True) -> GradientTransformation:
    """A transformation without state from ``fn(updates, params) -> updates``."""

    def update(updates: PyTree, state: EmptyState, params: PyTree = None) -> tuple[PyTree, EmptyState]:
        return fn(updates, params), state

    return GradientTransformation(lambda params: EmptyState(), update, elementwise)


def scale(step_size: float | torch.Tensor) -> GradientTransformation:
    """Multiply every update by a constant.

    >>> scale(-2.0).update({"w": torch.ones(1)}, EmptyState())[0]
    {'w': tensor([-2.])}
    """
    return _stateless(lambda updates, params: _scale_all(updates, step_size))


def _scale_all(updates: PyTree, factor: float | torch.Tensor) -> PyTree:
    """``u * factor`` for every update (``None`` kept)."""
    k, (us,), rebuild = columns(updates)
    return rebuild(k.mul(us, factor))


def scale_by_schedule(schedule: Schedule) -> GradientTransformation:
    """Multiply the updates of step ``count`` (0 for the first update) by ``schedule(count)``.

    >>> opt = scale_by_schedule(lambda count: 1.0 / (count + 1))
    >>> opt.update({"w": torch.ones(1)}, opt.init(None))[0]
    {'w': tensor([1.])}
    """

    def init(params: PyTree) -> ScaleByScheduleState:
        return ScaleByScheduleState(zero_count(params))

    def update(updates: PyTree, state: ScaleByScheduleState, params: PyTree = None) -> tuple[PyTree, Any]:
        factor = schedule(state.count)
        return _scale_all(updates, factor), ScaleByScheduleState(state.count + 1)

    return GradientTransformation(init, update, elementwise=True)


def scale_by_learning_rate(learning_rate: ScalarOrSchedule) -> GradientTransformation:
    """Multiply by ``-learning_rate``: a float, a 0-d tensor, or a schedule ``count -> lr``.

    >>> scale_by_learning_rate(0.1).update({"w": torch.ones(1)}, EmptyState())[0]
    {'w': tensor([-0.1000])}
    """
    if callable(learning_rate):
        return scale_by_schedule(lambda count: -learning_rate(count))
    return scale(-learning_rate)


def add_decayed_weights(weight_decay: float = 0.0, mask: MaskOrFn = None) -> GradientTransformation:
    """Add ``weight_decay * param`` to each update (decoupled when followed by a learning-rate scale).

    Args:
        weight_decay: the decay coefficient.
        mask: which params decay: a pytree of bools with the params' structure, or a function
            ``params -> such a tree`` (e.g. "matrices only"). ``None`` decays every param.

    Returns:
        A stateless transformation; its ``update`` needs ``params``.

    Raises:
        ValueError: ``params`` not given, or a mask whose structure differs from the params'.
        TypeError: a mask leaf that is not a bool.

    >>> opt = add_decayed_weights(0.5, mask={"w": True, "b": False})
    >>> p = {"w": torch.ones(1), "b": torch.ones(1)}
    >>> opt.update({"w": torch.zeros(1), "b": torch.zeros(1)}, EmptyState(), p)[0]
    {'w': tensor([0.5000]), 'b': tensor([0.])}
    """

    def decay(updates: PyTree, params: PyTree) -> PyTree:
        if params is None:
            raise optim_error(
                "add_decayed_weights (weight decay) needs the params", "call update(grads, state, params)"
            )
        keep = _resolve_mask(mask, params)
        k, (us, ps, ms), rebuild = columns(updates, params, keep)
        # u + weight_decay * p on the masked-in leaves only, as two foreach ops over that subset.
        decayed = k.mul([p for p, m in zip(ps, ms) if m], weight_decay)
        k.add_(decayed, [u for u, m in zip(us, ms) if m])  # wd * p + u: IEEE addition commutes, bitwise
        decayed = iter(decayed)
        return rebuild([next(decayed) if m else u for u, m in zip(us, ms)])

    return _stateless(decay)


def _resolve_mask(mask: MaskOrFn, params: PyTree) -> PyTree:
    if mask is None:
        return tree.map(lambda p: True, params)
    resolved = mask(params) if callable(mask) else mask
    if tree.structure(resolved) != tree.structure(params):
        param_paths = [tree.keystr(p) for p, _ in tree.leaves_with_path(params)]
        mask_paths = [tree.keystr(p) for p, _ in tree.leaves_with_path(resolved)]
        missing = [p for p in param_paths if p not in mask_paths]
        extra = [p for p in mask_paths if p not in param_paths]
        raise optim_error(
            f"weight-decay mask does not match the params' tree: params without a mask entry: "
            f"{', '.join(missing) or 'none'}; mask entries without a param: {', '.join(extra) or 'none'}",
            "give one bool per param leaf, in the same containers, e.g. core.tree.map(lambda p: p.ndim >= 2, params)",
        )
    for path, m in tree.leaves_with_path(resolved):
        if not isinstance(m, bool):
            raise optim_error(
                f"weight-decay mask at {tree.keystr(path) or '<root>'}: expected a bool, got {type(m).__name__}",
                "use Python bools (True = decay this param)",
                cls=TypeError,
            )
    return resolved


def trace(decay: float, nesterov: bool = False) -> GradientTransformation:
    """Momentum as in ``torch.optim.SGD`` (dampening 0): ``t = decay * t + g``.

    The update is ``t`` (heavy ball) or ``g + decay * t`` (Nesterov).

    >>> opt = trace(0.9)
    >>> u, s = opt.update({"w": torch.ones(1)}, opt.init({"w": torch.zeros(1)}))
    >>> opt.update({"w": torch.ones(1)}, s)[0]
    {'w': tensor([1.9000])}
    """

    def init(params: PyTree) -> TraceState:
        return TraceState(zeros_like_params(params))

    def update(updates: PyTree, state: TraceState, params: PyTree = None) -> tuple[PyTree, TraceState]:
        k, (gs, ts), rebuild = columns(updates, state.trace)
        new_trace = k.add(k.mul(ts, decay), gs)
        out = k.add(gs, k.mul(new_trace, decay)) if nesterov else new_trace
        return rebuild(out), TraceState(rebuild(new_trace))

    return GradientTransformation(init, update, elementwise=True)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam's preconditioning with bias correction, in ``torch.optim.AdamW``'s arithmetic.

    With ``t`` the step number (1 for the first update)::

        mu = lerp(mu, g, 1 - b1)                       # b1 * mu + (1 - b1) * g
        nu = b2 * nu + (1 - b2) * g * g
        update = (mu / (1 - b1**t)) / (sqrt(nu) / sqrt(1 - b2**t) + eps)

    >>> opt = scale_by_adam()
    >>> opt.update({"w": torch.tensor([2.0])}, opt.init({"w": torch.zeros(1)}))[0]
    {'w': tensor([1.0000])}
    """

    def init(params: PyTree) -> ScaleByAdamState:
        return ScaleByAdamState(zero_count(params), zeros_like_params(params), zeros_like_params(params))

    def update(updates: PyTree, state: ScaleByAdamState, params: PyTree = None) -> tuple[PyTree, ScaleByAdamState]:
        count = state.count + 1
        t = count.to(torch.float32)
        bias1, bias2_sqrt = _one_minus_pow(b1, t), _one_minus_pow(b2, t).sqrt()
        k, (gs, ms, vs), rebuild = columns(updates, state.mu, state.nu)
        mu = k.lerp(ms, gs, 1 - b1)
        nu = k.mul(vs, b2)
        k.addcmul_(nu, gs, gs, value=1 - b2)
        denom = k.div(k.sqrt(nu), bias2_sqrt)
        k.add_(denom, eps)
        out = k.div(mu, bias1)
        k.div_(out, denom)
        return rebuild(out), ScaleByAdamState(count, rebuild(mu), rebuild(nu))

    return GradientTransformation(init, update, elementwise=True)


def _one_minus_pow(b: float, t: torch.Tensor) -> torch.Tensor:
    """``1 - b**t`` as a 0-d float32 tensor, accurate to float32 rounding.

    The naive form cancels catastrophically (``1 - 0.999`` in float32 is off by 1e-5, relative);
    ``-expm1(t * log b)`` is not. A 0-d tensor, because DTensor accepts one next to any placement.
    """
    log_b = math.log(b) if b > 0 else -math.inf
    return -torch.expm1(t * log_b)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all updates together so their global L2 norm is at most ``max_norm``.

    As ``torch.nn.utils.clip_grad_norm_``: the factor is ``min(1, max_norm / (norm + 1e-6))``,
    applied unconditionally (no branch on the norm's value). With DTensor leaves the norm is
    that of the global tensors (see :func:`~core.optim.base.global_norm`).

    Raises:
        ValueError: ``max_norm`` not positive.

    >>> clip_by_global_norm(1.0).update({"w": torch.tensor([3.0, 4.0])}, EmptyState())[0]
    {'w': tensor([0.6000, 0.8000])}
    """
    if not max_norm > 0:
        raise optim_error(f"clip_by_global_norm: max_norm must be > 0, got {max_norm!r}", "pass e.g. 1.0")

    def clip(updates: PyTree, params: PyTree) -> PyTree:
        factor = (max_norm / (global_norm(updates) + 1e-6)).clamp(max=1.0)
        k, (us,), rebuild = columns(updates)
        dtypes = {u.dtype for u in us}
        # One factor per dtype, rounded like each update; a single 0-d tensor when all dtypes agree.
        by_dtype = factor.to(*dtypes) if len(dtypes) == 1 else [factor.to(u.dtype) for u in us]
        return rebuild(k.mul(us, by_dtype))

    return _stateless(clip, elementwise=False)  # the norm reduces over every element
