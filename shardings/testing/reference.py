"""The single-device reference of an equivalence check (:mod:`shardings.testing.equivalence`): per step its loss,
grads and params, and how far rounding noise could move each of them (the allowances the comparison adds).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

import core
from core import tree
from shardings.testing.tolerance import largest, tolerance

__all__ = ["low_dtype", "reference_steps"]


def low_dtype(policy: Any) -> torch.dtype | None:
    """The least precise of a policy's compute and reduce dtypes (``None`` without a policy): what the
    tolerance rule takes its epsilon from."""
    if policy is None:
        return None
    return max((policy.compute_dtype, policy.reduce_dtype), key=lambda d: torch.finfo(d).eps)


def _with_policy(loss_fn: Callable, policy: Any) -> Callable:
    """The single-device loss under a precision policy: params cast to compute dtype, gradients rounded to the
    reduce dtype (their reduction's), returned in the params' dtype; scaled by the policy's initial loss scale."""
    if policy is None:
        return core.value_and_grad(loss_fn)
    scale = policy.scaler.initial if policy.scaler is not None else 1.0

    def value_and_grad(params: Any, batch: Any) -> tuple[torch.Tensor, Any]:
        loss, grads = core.value_and_grad(lambda p: loss_fn(policy.cast_to_compute(p), batch) * scale)(params)
        return loss / scale, tree.map(lambda g, p: policy.cast_to_reduce(g).to(p.dtype) / scale, grads, params)

    return value_and_grad


def reference_steps(init, loss_fn, cfg, batch, optimizer, steps, key, clip_norm, terms, ulps, policy=None,
                    tolerances=None):
    """Per step the single-device ``(loss, grads, params)``, and how far rounding noise could move each of them.

    The second part runs the same optimizer twice more beside the reference, each on its own
    gradients pushed up and down by the largest difference the tolerance rule allows them. An
    optimizer that normalizes the gradient (Adam's ``m / √v``) turns gradient noise near zero
    into a step of about the learning rate; these two runs measure that amplification, element by
    element, so the params comparison allows exactly it and no more (plain SGD: almost nothing).
    From step 2 on, the loss and gradients those runs compute at their own params measure how far
    that allowed params noise moves the loss and gradients in turn (the same allowance, one step later).
    The pushes are the rule's for each leaf: its tree's floor, and a ``tolerances`` override's ulps.
    """
    params = init(key, cfg)
    ulps_of = lambda path: next((u for rx, u in (tolerances or {}).items() if re.search(rx, path)), ulps)
    value_and_grad = _with_policy(loss_fn, policy)
    dtype = low_dtype(policy)
    opt = core.optim.chain(core.optim.clip_by_global_norm(clip_norm), optimizer) if clip_norm else optimizer
    state = opt.init(params)
    noisy = [(sign, params, opt.init(params)) for sign in (1.0, -1.0)]
    out, slack = [], []
    for step in range(steps):
        loss, grads = value_and_grad(params, batch)
        seen = []  # (loss, grads) of each noisy run at its own params
        for j, (sign, p, st) in enumerate(noisy):
            g_loss, g = (loss, grads) if step == 0 else value_and_grad(p, batch)
            seen.append((g_loss, g))
            floor = largest(g)
            pushed = tree.map_with_path(lambda path, x, sign=sign, floor=floor: x + sign * _allowed(
                x, terms, ulps_of(tree.keystr(path)), dtype, floor), g)
            updates, st = opt.update(pushed, st, p)
            noisy[j] = (sign, core.optim.apply_updates(p, updates), st)
        updates, state = opt.update(grads, state, params)
        params = core.optim.apply_updates(params, updates)
        out.append((loss, grads, params))
        slack.append({
            "loss": _spread(loss, [s[0] for s in seen]),
            "grads": _spread(grads, [s[1] for s in seen]),
            "params": _spread(params, [p for _, p, _ in noisy]),
        })
    return out, slack


def _spread(want: Any, others: list[Any]) -> dict[str, torch.Tensor]:
    """Per key path, the elementwise largest ``|other - want|`` over ``others``."""
    moved = [tree.map(lambda a, b: (a - b).abs(), o, want) for o in others]
    return {tree.keystr(k): torch.maximum(x, y) for (k, x), y in
            zip(tree.leaves_with_path(moved[0]), tree.leaves(moved[1]))}


def _allowed(g: torch.Tensor, terms: int, ulps: float, dtype: torch.dtype | None = None,
             floor: float | None = None) -> torch.Tensor:
    """The largest difference from ``g`` the rule accepts, per element (``floor``: its tree's largest magnitude)."""
    if not g.numel():
        return torch.zeros_like(g)
    tol = tolerance(g, terms=terms, ulps=ulps, dtype=dtype, floor=floor)
    return tol.atol + tol.rtol * g.detach().abs()
