"""AdamW's whole step in torch's fused kernel, writing into donated buffers (``fused_step``).

``adamw(...).update`` is pure: every op allocates a fresh list of tensors, about six passes over
the params per step. A train step that owns its inputs (``train_step(donate=True)``, like JAX's
``donate_argnums``) can instead hand the params and moments to ``torch._fused_adamw_``, which
reads each element once and updates params, ``mu`` and ``nu`` in place (CPU and CUDA kernels; on
gpt_small, ``python -m experiments.bench.optim``: 5.2 ms against 32.5 ms for the pure form and
17.4 ms for torch's foreach AdamW). The result equals ``update`` + ``apply_updates`` to float
rounding: the kernel decays ``p *= 1 - lr * wd`` before adding the Adam step, where the pure form
adds ``wd * p`` to the step.

>>> opt = adamw(1e-3)
>>> params = {"w": torch.ones(2)}
>>> new_params, state = opt.fused_step({"w": torch.ones(2)}, opt.init(params), params)
>>> new_params["w"] is params["w"]  # written in place
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from core import compat, tree
from core.optim.base import ScalarOrSchedule
from core.optim.foreach import columns
from core.optim.transforms import ScaleByScheduleState, _resolve_mask

__all__ = ["adamw_step", "fusable"]

PyTree = tree.PyTree


# Matched by name (core never imports torch.distributed): a simulated rank's block is a LocalTensor,
# whose ops (the fused kernel too) run on each rank's plain tensor.
_FUSABLE_TYPES = frozenset({"Tensor", "Parameter", "LocalTensor", "FakeTensor"})  # FakeTensor: the planner's steps


def fusable(*trees: PyTree) -> bool:
    """Whether every tensor leaf is a plain tensor (or a simulated rank's ``LocalTensor``): the fused
    kernels take those, not a ``DTensor``.

    >>> fusable({"w": torch.ones(1)}, (torch.zeros(1), None))
    True
    """
    return all(type(x).__name__ in _FUSABLE_TYPES for t in trees for x in tree.leaves(t) if isinstance(x, torch.Tensor))


def adamw_step(learning_rate: ScalarOrSchedule, b1: float, b2: float, eps: float, weight_decay: float,
               mask: Callable[[PyTree], PyTree] | PyTree | None) -> Callable[..., tuple[PyTree, PyTree]]:
    """The ``fused_step`` of :func:`~core.optim.aliases.adamw` with these hyperparameters; its state is
    adamw's ``(ScaleByAdamState, [EmptyState,] EmptyState | ScaleByScheduleState)``."""
    def step(grads: PyTree, state: tuple, params: PyTree) -> tuple[PyTree, tuple]:
        adam, lr_state = state[0], state[-1]
        count = adam.count + 1
        lr = learning_rate(lr_state.count) if callable(learning_rate) else learning_rate
        keep = _resolve_mask(mask, params) if weight_decay else tree.map(lambda p: False, params)
        _, (gs, ps, ms, vs, decays), _ = columns(grads, params, adam.mu, adam.nu, keep)  # None grads: untouched
        # the kernel walks each tensor's memory in order: a gradient laid out unlike its parameter (a
        # transposed matmul's, say) is copied into the parameter's layout first
        gs = [g if g.stride() == p.stride() else torch.empty_like(p, dtype=g.dtype).copy_(g) for g, p in zip(gs, ps)]
        groups: dict[tuple[Any, ...], list[int]] = {}  # one kernel call per (device, dtypes, decay)
        for i, (g, p) in enumerate(zip(gs, ps)):
            groups.setdefault((p.device, p.dtype, g.dtype, decays[i]), []).append(i)
        t = count.to(torch.float32)
        for (_, _, _, decay), idx in groups.items():
            compat.fused_adamw([ps[i] for i in idx], [gs[i] for i in idx], [ms[i] for i in idx],
                               [vs[i] for i in idx], [], [t] * len(idx), lr=lr, beta1=b1, beta2=b2,
                               weight_decay=weight_decay if decay else 0.0, eps=eps, amsgrad=False,
                               maximize=False)
        new_lr_state = ScaleByScheduleState(lr_state.count + 1) if callable(learning_rate) else lr_state
        new_state = (adam._replace(count=count), *state[1:-1], new_lr_state)
        return params, new_state  # the same buffers, updated

    return step
