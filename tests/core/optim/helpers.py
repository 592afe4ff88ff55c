"""Shared strategies and runners: random param trees, and 10-step runs of ours vs ``torch.optim``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from hypothesis import strategies as st

from core import optim, tree
from shardings.testing import assert_close

shapes = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)
# A dict with a nested list, so key paths and nesting are exercised: {"w0": ..., "blocks": [...]}.
tree_shapes = st.builds(
    lambda top, nested: {**{f"w{i}": s for i, s in enumerate(top)}, "blocks": nested},
    st.lists(shapes, min_size=1, max_size=2),
    st.lists(shapes, min_size=1, max_size=2),
)


def random_tree(shape_tree, seed: int, scale: float = 1.0):
    """A tree of random float32 tensors with the given shapes (tuples are leaves)."""
    gen = torch.Generator().manual_seed(seed)
    return tree.map(lambda s: scale * torch.randn(s, generator=gen), shape_tree, is_leaf=lambda x: isinstance(x, tuple))


def grad_sequence(shape_tree, seed: int, steps: int = 10, scale: float = 1.0) -> list:
    return [random_tree(shape_tree, seed + 1000 + i, scale) for i in range(steps)]


def run_ours(opt: optim.GradientTransformation, params, grads_seq):
    state = opt.init(params)
    for grads in grads_seq:
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return params


def run_torch(
    make_opt: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    params,
    grads_seq,
    before_step: Callable[[list[torch.Tensor], torch.optim.Optimizer, int], None] = lambda ps, opt, i: None,
):
    """Run a ``torch.optim`` optimizer on clones of ``params``; ``before_step`` may clip grads or set the lr."""
    flat, treedef = tree.flatten(params)
    ps = [p.clone().requires_grad_(True) for p in flat]
    opt = make_opt(ps)
    for i, grads in enumerate(grads_seq):
        for p, g in zip(ps, tree.leaves(grads)):
            p.grad = g.clone()
        before_step(ps, opt, i)
        opt.step()
    return tree.unflatten(treedef, [p.detach() for p in ps])


def assert_trees_close(actual, expected, *, start=None, moved: float = 0.0) -> None:
    """Same tree structure and every leaf close by the project's rule (``shardings.testing.assert_close``).

    ``start`` (the params before the run) and ``moved`` (how far the optimizer may move one entry in the
    run: ``lr × steps`` for Adam, whose update is about ±lr per step) give the rule the magnitude of the
    terms each final entry is the sum of: a one-entry leaf that ends near zero after ten steps of ±lr has
    no larger entry beside it to scale the floor (``make test-explore`` found one: lr 0.18, 1.5e-7 apart).

    Not bitwise: ours computes ``p + (-lr) * (u + wd * p)`` (optax's composition) where torch
    computes ``p * (1 - lr * wd) - lr * u``. Both round to float32 at every step, so an entry that
    cancels to near zero keeps an absolute error of a few ulps of the O(1) terms it came from
    (observed 2.2e-7 with lr 0.3): the rule's floor, proportional to the leaf's largest magnitude,
    absorbs it, while a wrong formula is off by ~lr.
    """
    scale = max((float(x.abs().max()) for x in tree.leaves(start) if x.numel()), default=0.0) if start else 0.0
    assert_close(actual, expected, magnitude=scale + moved)
