"""Pytree utilities over ``torch.utils._pytree``.

Using torch's own registry means ``torch.func`` and ``torch.compile`` see exactly the trees
we do: dicts, lists, tuples, NamedTuples and dataclasses registered with
:func:`register_dataclass` are nodes; everything else (tensors, DTensors, numbers, None) is a leaf.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.utils._pytree as _pt

PyTree = Any
KeyPath = tuple[Any, ...]
TreeDef = _pt.TreeSpec

__all__ = [
    "KeyPath",
    "PyTree",
    "TreeDef",
    "flatten",
    "flatten_with_path",
    "keystr",
    "leaves",
    "leaves_with_path",
    "map",
    "map_with_path",
    "register_dataclass",
    "structure",
    "unflatten",
]



def map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> PyTree:
    """Apply ``fn`` to every leaf (and the matching leaves of ``rest``), keeping the structure.

    >>> map(lambda a, b: a + b, {"w": 1, "b": [2]}, {"w": 10, "b": [20]})
    {'w': 11, 'b': [22]}
    """
    return _pt.tree_map(fn, tree, *rest, is_leaf=is_leaf)


def map_with_path(
    fn: Callable[..., Any], tree: PyTree, *rest: PyTree, is_leaf: Callable[[Any], bool] | None = None
) -> PyTree:
    """Like :func:`map`, but ``fn(path, leaf, *rest_leaves)`` also receives the leaf's key path."""
    return _pt.tree_map_with_path(fn, tree, *rest, is_leaf=is_leaf)


def leaves(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> list[Any]:
    """The leaves of ``tree`` in flattening order."""
    return _pt.tree_leaves(tree, is_leaf=is_leaf)


def leaves_with_path(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> list[tuple[KeyPath, Any]]:
    """``(path, leaf)`` pairs in flattening order."""
    return _pt.tree_leaves_with_path(tree, is_leaf=is_leaf)


def flatten(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], TreeDef]:
    """Split ``tree`` into its leaves and a treedef; :func:`unflatten` inverts it."""
    return _pt.tree_flatten(tree, is_leaf=is_leaf)


def flatten_with_path(
    tree: PyTree, is_leaf: Callable[[Any], bool] | None = None
) -> tuple[list[tuple[KeyPath, Any]], TreeDef]:
    """Like :func:`flatten`, with each leaf paired with its key path."""
    return _pt.tree_flatten_with_path(tree, is_leaf=is_leaf)


def unflatten(treedef: TreeDef, leaves: Sequence[Any]) -> PyTree:
    """Rebuild a tree from a treedef and its leaves."""
    return _pt.tree_unflatten(list(leaves), treedef)


def structure(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> TreeDef:
    """The treedef of ``tree``."""
    return _pt.tree_structure(tree, is_leaf=is_leaf)


def keystr(path: KeyPath) -> str:
    """A readable, stable string for a key path: ``['blocks'][0]['attn']['wq']``, ``.mu['w']``."""
    return _pt.keystr(path)


def register_dataclass(cls: type) -> type:
    """Register a dataclass as a pytree node (all fields are children). Usable as a decorator."""
    _pt.register_dataclass(cls)
    return cls
