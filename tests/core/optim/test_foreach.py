"""The foreach kernels give bitwise the results of the per-leaf formulas they replaced.

References: ``_old_adamw`` / ``_old_sgd`` are the per-leaf ``tree.map`` implementations the
transforms had before they moved to ``torch._foreach_*`` (same ops, same order), and
``foreach.per_leaf()`` runs today's code leaf by leaf. Plain tensors, ``LocalTensor`` leaves
(simulated ranks) and ``DTensor`` leaves are covered.
"""

import contextlib
import math
from unittest import mock

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.distributed._local_tensor import LocalTensor
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import shardings
from core import optim, tree
from core.optim import foreach
from shardings import Mesh
from shardings.testing import assert_close
from tests.core.optim.helpers import grad_sequence, random_tree, tree_shapes

dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float64, "mixed"])
seeds = st.integers(0, 2**16)
steps = st.integers(1, 4)


def _cast(t, dtype):
    """Cast a tree to ``dtype``; "mixed" alternates float32 / bfloat16 leaf by leaf."""
    flat, treedef = tree.flatten(t)
    pick = (lambda i: (torch.float32, torch.bfloat16)[i % 2]) if dtype == "mixed" else (lambda i: dtype)
    return tree.unflatten(treedef, [x.to(pick(i)) for i, x in enumerate(flat)])


def _run(opt, params, grads_seq, state=None):
    """Params and optimizer state after the steps (the state checks the moments bitwise too)."""
    state = opt.init(params) if state is None else state
    for grads in grads_seq:
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return params, state


def _assert_bitwise(actual, expected):
    assert tree.structure(actual) == tree.structure(expected)
    for (path, a), b in zip(tree.leaves_with_path(actual), tree.leaves(expected)):
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype, tree.keystr(path)
            assert torch.equal(a, b), f"{tree.keystr(path)}: max diff {(a.double() - b.double()).abs().max()}"


def _old_adamw(params, grads_seq, lr, b1, b2, eps, wd):
    """adamw before foreach: scale_by_adam, add_decayed_weights, scale(-lr), apply_updates per leaf."""
    mu, nu = (tree.map(torch.zeros_like, params) for _ in range(2))
    for t, grads in enumerate(grads_seq, start=1):
        tt = torch.tensor(t, dtype=torch.float32)
        bias1, bias2_sqrt = -torch.expm1(tt * math.log(b1)), (-torch.expm1(tt * math.log(b2))).sqrt()
        mu = tree.map(lambda g, m: m.lerp(g, 1 - b1), grads, mu)
        nu = tree.map(lambda g, v: v.mul(b2).addcmul(g, g, value=1 - b2), grads, nu)
        u = tree.map(lambda m, v, b1c=bias1, b2c=bias2_sqrt: (m / b1c) / (v.sqrt() / b2c + eps), mu, nu)
        u = tree.map(lambda u, p: u + wd * p, u, params) if wd else u
        u = tree.map(lambda u: u * -lr, u)
        params = tree.map(lambda p, u: (p + u).to(p.dtype), params, u)
    return params


def _old_sgd(params, grads_seq, lr, momentum, nesterov, wd):
    trace = tree.map(torch.zeros_like, params)
    for grads in grads_seq:
        g = tree.map(lambda u, p: u + wd * p, grads, params)
        trace = tree.map(lambda g, t: t * momentum + g, g, trace)
        d = tree.map(lambda g, t: g + momentum * t, g, trace) if nesterov else trace
        params = tree.map(lambda p, u: (p + u * -lr).to(p.dtype), params, d)
    return params


@settings(max_examples=15)
@given(tree_shapes, seeds, steps, dtypes, st.sampled_from([0.9, 0.5]), st.sampled_from([0.0, 0.1]))
def test_adamw_equals_the_old_per_leaf_formulas(shapes, seed, n, dtype, b1, wd):
    params, grads = _cast(random_tree(shapes, seed), dtype), [_cast(g, dtype) for g in grad_sequence(shapes, seed, n)]
    kw = dict(lr=0.01, b1=b1, b2=0.999, eps=1e-8)
    got, _ = _run(optim.adamw(kw["lr"], kw["b1"], kw["b2"], kw["eps"], weight_decay=wd), params, grads)
    _assert_bitwise(got, _old_adamw(params, grads, **kw, wd=wd))


@settings(max_examples=15)
@given(tree_shapes, seeds, steps, dtypes, st.booleans())
def test_sgd_equals_the_old_per_leaf_formulas(shapes, seed, n, dtype, nesterov):
    params, grads = _cast(random_tree(shapes, seed), dtype), [_cast(g, dtype) for g in grad_sequence(shapes, seed, n)]
    got, _ = _run(optim.sgd(0.1, momentum=0.9, nesterov=nesterov, weight_decay=0.01), params, grads)
    _assert_bitwise(got, _old_sgd(params, grads, 0.1, 0.9, nesterov, 0.01))


def _optimizers():
    no_vectors = lambda p: tree.map(lambda x: x.ndim >= 2, p)
    return {
        "clip_adamw": optim.chain(
            optim.clip_by_global_norm(0.5),
            optim.adamw(optim.warmup_cosine(0.1, 1, 4), weight_decay=0.1, mask=no_vectors),
        ),
        "sgd": optim.sgd(optim.linear(0.1, 0.01, 3), momentum=0.9, nesterov=True, weight_decay=0.01),
        "scale": optim.chain(optim.scale(0.5), optim.scale_by_learning_rate(torch.tensor(0.1))),
    }


def _per_leaf_norm(updates):
    with foreach.per_leaf():
        return optim.global_norm(updates)


@settings(max_examples=20)
@given(tree_shapes, seeds, steps, dtypes, st.sampled_from(sorted(_optimizers())))
def test_foreach_equals_per_leaf_for_every_transform(shapes, seed, n, dtype, name):
    """Clipping's norm is computed per leaf in both runs: global_norm alone is not bitwise (tested below)."""
    opt = _optimizers()[name]
    params, grads = _cast(random_tree(shapes, seed), dtype), [_cast(g, dtype) for g in grad_sequence(shapes, seed, n)]
    with foreach.per_leaf():
        expected = _run(opt, params, grads)
    with mock.patch.object(optim.transforms, "global_norm", _per_leaf_norm):
        _assert_bitwise(_run(opt, params, grads), expected)


@settings(max_examples=15)
@given(tree_shapes, seeds, st.sampled_from([torch.float32, torch.bfloat16, "mixed"]), st.sampled_from([1e-3, 1.0, 1e3]))
def test_global_norm_matches_the_sum_of_squares(shapes, seed, dtype, scale):
    """Foreach: per-leaf norms, then their norm (as ``clip_grad_norm_``); per leaf: one sum of squares.

    Different summation orders, both in float32: the project's rule allows ~32 ulps, far above the few
    ulps of reordering a sum of a few dozen squares and far below any wrong formula (off by O(1)).
    """
    updates = _cast(random_tree(shapes, seed, scale), dtype)
    got = optim.global_norm(updates)
    assert_close(got, _per_leaf_norm(updates))
    assert got.dtype == torch.float32 and got.ndim == 0


def test_kernels_follow_the_leaf_types():
    class Tagged(torch.Tensor):  # an unknown subclass: no promise its foreach ops match
        pass

    plain = {"a": torch.ones(2), "b": None}
    assert foreach.columns(plain).kernels is foreach.FOREACH
    assert foreach.columns({"a": torch.ones(2).as_subclass(Tagged)}).kernels is foreach.PER_LEAF
    with shardings.simulate(2):  # a bare LocalTensor: see core/optim/foreach.py for torch's nesting quirk
        local = LocalTensor({r: torch.full((2,), float(r)) for r in range(2)})
        assert foreach.columns({"a": local}).kernels is foreach.PER_LEAF
        out = optim.scale_by_learning_rate(torch.tensor(0.5)).update({"a": local}, optim.EmptyState())[0]["a"]
        assert [v.tolist() for v in shardings.per_rank(out)] == [[-0.0, -0.0], [-0.5, -0.5]]
    with foreach.per_leaf():
        assert foreach.columns(plain).kernels is foreach.PER_LEAF
    assert foreach.columns(plain).kernels is foreach.FOREACH
    # None updates stay None, an all-None tree and an empty mask selection do not reach torch's foreach.
    assert foreach.columns(plain).rebuild([torch.zeros(2)])["b"] is None
    assert optim.apply_updates({"a": torch.ones(1)}, {"a": None})["a"].tolist() == [1.0]
    opt = optim.add_decayed_weights(0.1, mask={"a": False})
    assert opt.update({"a": torch.ones(1)}, optim.EmptyState(), {"a": torch.ones(1)})[0]["a"].tolist() == [1.0]


PLACEMENTS = [(Replicate(), Replicate()), (Shard(0), Replicate()), (Replicate(), Shard(0)), (Shard(1), Shard(0))]
SHAPES = {"w": (4, 6), "proj": (5, 3), "blocks": [(2, 2), (3, 4)]}


@settings(max_examples=4)
@given(st.lists(st.sampled_from(PLACEMENTS), min_size=4, max_size=4), seeds, st.sampled_from(sorted(_optimizers())))
@example([PLACEMENTS[0]] * 3 + [PLACEMENTS[1]], 0, "scale")  # found by make test-explore
def test_simulated_ranks_foreach_equals_per_leaf(placements, seed, name):
    """DTensor leaves (simulated ranks): the same local values and placements on every rank.

    The optimizer state is kept sharded on dim 0 whatever the params' placements (ZeRO's
    shape), so the foreach ops must redistribute exactly as the per-leaf ops do.
    """
    opt = _optimizers()[name]
    params, grads = random_tree(SHAPES, seed), grad_sequence(SHAPES, seed, steps=2)
    with shardings.simulate(4):  # global_norm of DTensors is per leaf on both paths: one reduction
        mesh = Mesh(dp=2, tp=2).device_mesh
        pls = tree.unflatten(tree.structure(params), placements)
        dist = lambda t: tree.map(lambda x, pl: distribute_tensor(x, mesh, list(pl)), t, pls)
        d_params, d_grads = dist(params), [dist(g) for g in grads]
        zero = lambda x: x.redistribute(mesh, [Shard(0), Replicate()]) if isinstance(x, DTensor) and x.ndim else x
        state = tree.map(zero, opt.init(d_params))
        with foreach.per_leaf():
            expected = _run(opt, d_params, d_grads, state)
        got = _run(opt, d_params, d_grads, state)
        assert all(isinstance(x, DTensor) for x in tree.leaves(got[0]))
        _assert_per_rank_bitwise(got, expected)


def _assert_per_rank_bitwise(actual, expected):
    assert tree.structure(actual) == tree.structure(expected)
    for a, b in zip(tree.leaves(actual), tree.leaves(expected)):
        if isinstance(b, DTensor):
            assert a.placements == b.placements
            a, b = a.to_local(), b.to_local()
        ra, rb = shardings.per_rank(a), shardings.per_rank(b)
        # A plain local tensor under simulate holds one value for every rank (found by make test-explore:
        # an all-Replicate leaf can come out of an op as a plain tensor on one path, a LocalTensor on the other).
        n = max(len(ra), len(rb))
        ra, rb = (ra * n if len(ra) == 1 else ra), (rb * n if len(rb) == 1 else rb)
        assert len(ra) == len(rb) == n
        for x, y in zip(ra, rb):
            assert torch.equal(x, y)


def test_updates_stay_differentiable():
    """In-place foreach ops only touch fresh intermediates autograd did not save: a meta-gradient
    through two AdamW steps (grads that require grad) equals the per-leaf one."""

    def meta(lr_scale, per_leaf):
        params = {"w": torch.ones(3), "b": torch.full((2,), 0.5)}
        grads = [{"w": torch.arange(1.0, 4.0) * lr_scale, "b": torch.ones(2) * lr_scale}] * 2
        with foreach.per_leaf() if per_leaf else contextlib.nullcontext():
            new, _ = _run(optim.adamw(0.1, weight_decay=0.1), params, grads)
        return torch.autograd.grad(sum(x.square().sum() for x in tree.leaves(new)), lr_scale)[0]

    scale = torch.tensor(2.0, requires_grad=True)
    got = meta(scale, per_leaf=False)
    assert torch.isfinite(got) and torch.equal(got, meta(scale, per_leaf=True))
