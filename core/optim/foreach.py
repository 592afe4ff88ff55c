"""Optimizer math over lists of leaves: one ``torch._foreach_*`` call per op for all leaves together.

A per-leaf ``tree.map`` costs a Python call and a dispatch per op per leaf; a foreach op takes the
whole list at once (CUDA fuses it into a few kernels; CPU loops in C++). Each transformation writes
its math once against :class:`Kernels` and :func:`columns` picks the implementation:

- ``FOREACH`` (``torch._foreach_*``) when every leaf is a plain tensor or a ``DTensor`` (also
  with simulated ranks): DTensor propagates foreach ops with the same output placements as the
  per-leaf ops (checked in tests/core/optim/test_foreach.py);
- ``PER_LEAF`` (the same ``torch.Tensor`` methods, leaf by leaf) for any other tensor subclass,
  and inside :func:`per_leaf` (tests and benchmarks compare the two). That includes a bare
  ``LocalTensor`` (not inside a DTensor): in torch 2.13 its foreach ops with a tensor scalar
  (``_foreach_mul(xs, lr)``) return a LocalTensor nested in a LocalTensor.

On CPU a foreach op runs the per-leaf kernel for each leaf, so both give bitwise equal results.

>>> k, (gs, ms), rebuild = columns({"w": torch.ones(2), "b": None}, {"w": torch.zeros(2), "b": None})
>>> rebuild(k.lerp(ms, gs, 0.5))
{'w': tensor([0.5000, 0.5000]), 'b': None}
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from core import compat, tree

__all__ = ["FOREACH", "PER_LEAF", "Columns", "Kernels", "columns", "per_leaf", "use_foreach"]

PyTree = tree.PyTree
Op = Callable[..., Sequence[torch.Tensor]]


class Kernels(NamedTuple):
    """List ops: the first argument is a list of tensors; each other argument is a list of the
    same length or one value (scalar or tensor) used for every leaf. The ``_`` ops write into
    their first list: use them only on fresh intermediates whose producer saved no output for
    autograd (``mul``, ``div``; not ``sqrt``), so the API stays pure and differentiable."""

    add: Op
    mul: Op
    div: Op
    sqrt: Op
    lerp: Op
    addcmul: Op
    add_: Op
    div_: Op
    addcmul_: Op


def _per_leaf_op(name: str) -> Op:
    method = getattr(torch.Tensor, name)

    def op(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
        n = len(args[0])
        cols = [a if isinstance(a, list | tuple) else [a] * n for a in args]
        return [method(*row, **kwargs) for row in zip(*cols)]

    return op


def _foreach_op(name: str) -> Op:
    fn = compat.foreach(name)
    if fn is None:  # a torch without this foreach kernel: one call per leaf
        return _per_leaf_op(name)
    # torch's foreach ops refuse an empty list (e.g. a weight-decay mask that selects nothing).
    return lambda *args, **kwargs: fn(*args, **kwargs) if len(args[0]) else []


FOREACH = Kernels(*(_foreach_op(name) for name in Kernels._fields))
PER_LEAF = Kernels(*(_per_leaf_op(name) for name in Kernels._fields))

# Matched by name: core never imports torch.distributed (where DTensor and LocalTensor live).
_FOREACH_TYPES = frozenset({"Tensor", "Parameter", "DTensor"})
_forced_per_leaf = False


@contextlib.contextmanager
def per_leaf() -> Iterator[None]:
    """Run the optimizer math leaf by leaf inside this block (a reference for tests and benchmarks).

    >>> with per_leaf():
    ...     use_foreach([torch.ones(1)])
    False
    """
    global _forced_per_leaf
    previous, _forced_per_leaf = _forced_per_leaf, True
    try:
        yield
    finally:
        _forced_per_leaf = previous


def use_foreach(leaves: Sequence[Any]) -> bool:
    """Whether ``torch._foreach_*`` ops apply to all these leaves (``None`` leaves are ignored).

    >>> use_foreach([torch.ones(1), None])
    True
    """
    return not _forced_per_leaf and all(x is None or type(x).__name__ in _FOREACH_TYPES for x in leaves)


class Columns(NamedTuple):
    """The leaves of ``updates`` that are not ``None``, lined up with the same leaves of other trees.

    Attributes:
        kernels: ``FOREACH`` or ``PER_LEAF`` for these leaves.
        lists: the updates' leaves, then the matching leaves of each other tree.
        rebuild: ``rebuild(list)`` puts a list like ``lists[0]`` back into the updates' tree,
            with ``None`` where the update was ``None``.
    """

    kernels: Kernels
    lists: tuple[list[Any], ...]
    rebuild: Callable[[Sequence[torch.Tensor]], PyTree]


def columns(updates: PyTree, *rest: PyTree) -> Columns:
    """Split ``updates`` and trees shaped like it (state, params, masks) into aligned leaf lists.

    Args:
        updates: a pytree of tensors or ``None`` (a leaf without a gradient).
        *rest: trees whose structure starts like ``updates``'s (as for ``tree.map``).

    Returns:
        A :class:`Columns`.
    """
    flat, treedef = tree.flatten(updates)
    others = [treedef.flatten_up_to(r) for r in rest]
    present = [i for i, u in enumerate(flat) if u is not None]
    lists = tuple([col[i] for i in present] for col in (flat, *others))
    kernels = FOREACH if use_foreach([x for col in lists for x in col if isinstance(x, torch.Tensor)]) else PER_LEAF

    def rebuild(values: Sequence[torch.Tensor]) -> PyTree:
        out: list[Any] = [None] * len(flat)
        for i, v in zip(present, values, strict=True):
            out[i] = v
        return tree.unflatten(treedef, out)

    return Columns(kernels, lists, rebuild)
