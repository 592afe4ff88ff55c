"""The optimizer protocol: ``GradientTransformation(init, update)``, ``chain``, ``apply_updates``.

As in optax, an optimizer is two pure functions in a NamedTuple: ``init(params) -> state`` and
``update(updates, state, params=None) -> (updates, new_state)``. States are NamedTuple pytrees,
so a layout can shard them exactly like the params they mirror (ZeRO). Nothing is mutated
(``fused_step`` is the one exception: it writes into buffers its caller donates).

Leaves may be plain tensors or DTensors (sharded or replicated). Every op used here is one
DTensor supports, scalars that depend on the step (bias corrections, learning rates) are 0-d
tensors, which DTensor accepts next to any placement, and no value is read back to Python, so
``torch.compile(..., fullgraph=True)`` traces an update without graph breaks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from core import compat, tree
from core.optim.foreach import columns, use_foreach

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "ScalarOrSchedule",
    "Schedule",
    "apply_updates",
    "chain",
    "global_norm",
]

PyTree = tree.PyTree
# A schedule maps the step count (a 0-d int tensor, or an int) to a 0-d float tensor.
Schedule = Callable[[torch.Tensor | int], torch.Tensor]
ScalarOrSchedule = float | torch.Tensor | Schedule


class GradientTransformation(NamedTuple):
    """A pure optimizer (or one building block of one).

    Attributes:
        init: ``init(params) -> state``; the state is a pytree (usually a NamedTuple).
        update: ``update(updates, state, params=None) -> (updates, new_state)``.
        elementwise: each output element depends only on the same element of the updates, state
            and params (plus step-count scalars), so the update may run on any shard of them
            alone (a sharded train step runs it on local blocks). ``False`` for anything that
            reduces across elements, such as a global-norm clip.
        fused_step: ``fused_step(grads, state, params) -> (new_params, new_state)``, the same as
            ``update`` then ``apply_updates`` (to float rounding) in one fused kernel that writes
            into the buffers of ``params`` and ``state`` (the caller donates them, as with JAX's
            ``donate_argnums``). Plain tensors (or simulated ranks' LocalTensors), not DTensors; ``None``
            where there is no fused form.
    """

    init: Callable[[PyTree], PyTree]
    update: Callable[..., tuple[PyTree, PyTree]]
    elementwise: bool = False
    fused_step: Callable[..., tuple[PyTree, PyTree]] | None = None


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


def optim_error(problem: str, fix: str, cls: type[Exception] = ValueError) -> Exception:
    """Build (not raise) a user-facing error that ends with the fix, in the project's wording."""
    return cls(f"{problem}. Fix: {fix.rstrip('.')}.")


def zeros_like_params(params: PyTree) -> PyTree:
    """Zeros shaped, typed and placed like each floating tensor leaf; ``None`` for other leaves."""
    return tree.map(lambda p: torch.zeros_like(p) if _is_float(p) else None, params)


def zero_count(params: PyTree) -> torch.Tensor:
    """A 0-d int32 step counter on the device of the first tensor leaf of ``params``."""
    device = next((p.device for p in tree.leaves(params) if isinstance(p, torch.Tensor)), None)
    return torch.zeros([], dtype=torch.int32, device=device)


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Compose transformations left to right; the state is the tuple of their states.

    Args:
        *transforms: applied in order, each to the updates the previous one returned.

    Returns:
        A single ``GradientTransformation``.

    >>> opt = chain(clip_by_global_norm(1.0), scale(-0.1))
    >>> state = opt.init({"w": torch.ones(2)})
    >>> opt.update({"w": torch.full((2,), 3.0)}, state)[0]["w"]
    tensor([-0.0707, -0.0707])
    """

    def init(params: PyTree) -> tuple[PyTree, ...]:
        return tuple(t.init(params) for t in transforms)

    def update(updates: PyTree, state: tuple[PyTree, ...], params: PyTree = None) -> tuple[PyTree, tuple]:
        if len(state) != len(transforms):
            raise optim_error(
                f"chain of {len(transforms)} transforms got a state with {len(state)} entries",
                "pass the state returned by this chain's init (or by its previous update)",
            )
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformation(init, update, all(t.elementwise for t in transforms))


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """Return ``params + updates`` leaf by leaf, in each param's dtype (a ``None`` update keeps the param).

    >>> apply_updates({"w": torch.ones(2)}, {"w": torch.full((2,), -0.5)})
    {'w': tensor([0.5000, 0.5000])}
    """
    k, (us, ps), rebuild = columns(updates, params)
    new = [x.to(p.dtype) for x, p in zip(k.add(ps, us), ps)]
    return tree.map(lambda p, x: p if x is None else x, params, rebuild(new))


def global_norm(updates: PyTree) -> torch.Tensor:
    """The L2 norm of all tensor leaves together, as a plain 0-d float32 tensor.

    With DTensor leaves this is the norm of the *global* tensors: each leaf contributes a
    (possibly ``Partial``) sum of squares, the sums stay ``Partial`` while they are added, and
    a single reduction at the end makes the total replicated on every rank.

    >>> global_norm({"a": torch.tensor([3.0]), "b": [torch.tensor([4.0])]})
    tensor(5.)
    """
    leaves = [u for u in tree.leaves(updates) if isinstance(u, torch.Tensor)]
    if not leaves:
        return torch.zeros([], dtype=torch.float32)
    norms = compat.foreach("norm")  # None on a torch without it: the sum of squares below
    if norms is not None and use_foreach(leaves) and not any(hasattr(u, "full_tensor") for u in leaves):
        # One foreach kernel for the per-leaf norms, then the norm of the norms (as
        # torch.nn.utils.clip_grad_norm_): equal to the sum of squares up to float rounding.
        # DTensor leaves keep the sum of squares below: it stays Partial and is reduced once.
        return torch.linalg.vector_norm(torch.stack(norms(leaves, 2, dtype=torch.float32)))
    squares = [u.float().square().sum() for u in leaves]
    total = sum(squares[1:], squares[0])
    # A DTensor total is reduced once and brought back as a plain 0-d tensor (no import of
    # torch.distributed here: core stays distribution-free), so it scales plain and DTensor leaves alike.
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    return total.sqrt()
