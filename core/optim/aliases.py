"""Ready-made optimizers, each a :func:`~core.optim.base.chain` of building blocks."""

from __future__ import annotations

from core.optim.base import GradientTransformation, ScalarOrSchedule, chain, optim_error
from core.optim.fused import adamw_step
from core.optim.transforms import MaskOrFn, add_decayed_weights, scale_by_adam, scale_by_learning_rate, trace

__all__ = ["adamw", "sgd"]


def sgd(
    learning_rate: ScalarOrSchedule, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0
) -> GradientTransformation:
    """Stochastic gradient descent, as ``torch.optim.SGD`` (dampening 0).

    Per step, with ``g`` the gradient: ``g += weight_decay * p`` (coupled L2), then momentum
    ``b = momentum * b + g`` and ``d = g + momentum * b`` (Nesterov) or ``d = b``, then
    ``p -= lr * d``.

    Args:
        learning_rate: a float, or a schedule ``count -> lr`` (count 0 on the first step).
        momentum: momentum factor; 0 keeps no state.
        nesterov: Nesterov momentum (needs ``momentum > 0``).
        weight_decay: L2 penalty added to the gradient.

    Returns:
        A ``GradientTransformation``.

    Raises:
        ValueError: negative hyperparameters, or ``nesterov`` without momentum.

    >>> opt = sgd(0.1, momentum=0.9)
    >>> params = {"w": torch.ones(2)}
    >>> updates, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
    >>> apply_updates(params, updates)["w"]
    tensor([0.9000, 0.9000])
    """
    _check_non_negative(momentum=momentum, weight_decay=weight_decay)
    if nesterov and momentum == 0:
        raise optim_error("sgd: nesterov=True needs momentum > 0", "pass e.g. momentum=0.9, or nesterov=False")
    parts = [add_decayed_weights(weight_decay)] if weight_decay else []
    parts += [trace(momentum, nesterov)] if momentum else []
    return chain(*parts, scale_by_learning_rate(learning_rate))


def adamw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    mask: MaskOrFn = None,
) -> GradientTransformation:
    """Adam with decoupled weight decay, as ``torch.optim.AdamW``.

    Per step ``t`` (from 1): ``p -= lr * (adam(g) + weight_decay * p)``, where ``adam`` is
    :func:`~core.optim.transforms.scale_by_adam` (bias-corrected moments); the decay term
    equals torch's ``p *= 1 - lr * weight_decay``.

    Args:
        learning_rate: a float, or a schedule ``count -> lr`` (count 0 on the first step).
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the bias-corrected root second moment.
        weight_decay: decoupled weight decay coefficient.
        mask: which params decay: a pytree of bools like the params, or ``params -> such a tree``.
            Typical: ``lambda p: core.tree.map(lambda x: x.ndim >= 2, p)`` (no decay on norms/biases).

    Returns:
        A ``GradientTransformation`` whose state is ``(ScaleByAdamState, EmptyState, ...)``, with a
        ``fused_step`` (torch's fused AdamW kernel, in place: :mod:`core.optim.fused`).

    Raises:
        ValueError: ``b1``/``b2`` outside ``[0, 1)`` or negative ``eps``/``weight_decay``.

    >>> opt = adamw(1e-3, weight_decay=0.1)
    >>> params = {"w": torch.ones(2)}
    >>> updates, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
    >>> apply_updates(params, updates)["w"]
    tensor([0.9989, 0.9989])
    """
    for name, b in (("b1", b1), ("b2", b2)):
        if not 0 <= b < 1:
            raise optim_error(f"adamw: {name} must be in [0, 1), got {b!r}", f"pass e.g. {name}=0.9")
    _check_non_negative(eps=eps, weight_decay=weight_decay)
    parts = [scale_by_adam(b1, b2, eps)]
    parts += [add_decayed_weights(weight_decay, mask)] if weight_decay else []
    fused = adamw_step(learning_rate, b1, b2, eps, weight_decay, mask)
    return chain(*parts, scale_by_learning_rate(learning_rate))._replace(fused_step=fused)


def _check_non_negative(**values: float) -> None:
    for name, v in values.items():
        if not v >= 0:
            raise optim_error(f"{name} must be >= 0, got {v!r}", f"pass {name}=0.0 to turn it off")
