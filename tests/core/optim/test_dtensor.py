"""DTensor leaves (sharded, replicated, uneven; ZeRO-sharded state) give the plain-tensor results.

Every run happens under ``shardings.simulate(4)`` on ``Mesh(dp=2, tp=2)``; results are compared
per rank (``full_tensor()`` on every rank) with the same optimizer run on plain tensors.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import shardings
from core import optim, tree
from shardings import Mesh
from shardings.testing import assert_close
from tests.core.optim.helpers import assert_trees_close, grad_sequence, random_tree, run_ours

PLACEMENTS = [
    (Replicate(), Replicate()),
    (Shard(0), Replicate()),
    (Replicate(), Shard(0)),
    (Shard(0), Shard(0)),  # dim 0 split 4 ways, major to minor
    (Shard(1), Shard(0)),
    (Shard(0), Shard(1)),
]
# 2-d leaves so every placement applies; 5 and 3 do not divide by 2: uneven shards.
SHAPES = {"w": (4, 6), "proj": (5, 3), "blocks": [(2, 2), (3, 4)]}


def _optimizers():
    decay_matrices = lambda p: tree.map(lambda x: x.shape[0] != 2, p)  # skips the (2, 2) leaf
    return {
        "sgd": optim.sgd(optim.linear(0.1, 0.01, 3), momentum=0.9, nesterov=True, weight_decay=0.01),
        "clip_adamw": optim.chain(
            optim.clip_by_global_norm(0.5),
            optim.adamw(optim.warmup_cosine(0.1, 1, 4), weight_decay=0.1, mask=decay_matrices),
        ),
    }


def _distribute(plain_tree, placements_tree, mesh):
    return tree.map(lambda t, pl: distribute_tensor(t, mesh, list(pl)), plain_tree, placements_tree)


def _assert_per_rank_close(dtensor_tree, expected):
    """Every rank's ``full_tensor()`` equals the plain result (see helpers for the tolerance's reason)."""
    for rank_values in zip(*(shardings.per_rank(x.full_tensor()) for x in tree.leaves(dtensor_tree))):
        assert_trees_close(tree.unflatten(tree.structure(expected), list(rank_values)), expected)


placement_trees = st.fixed_dictionaries(
    {
        "w": st.sampled_from(PLACEMENTS),
        "proj": st.sampled_from(PLACEMENTS),
        "blocks": st.lists(st.sampled_from(PLACEMENTS), min_size=2, max_size=2),
    }
)


@settings(max_examples=6)
@given(placement_trees, st.sampled_from(sorted(_optimizers())), st.integers(0, 100))
def test_sharded_params_and_grads_match_plain(placements, name, seed):
    opt = _optimizers()[name]
    params, grads = random_tree(SHAPES, seed), grad_sequence(SHAPES, seed, steps=3)
    expected = run_ours(opt, params, grads)
    with shardings.simulate(4):
        mesh = Mesh(dp=2, tp=2).device_mesh
        d_params = _distribute(params, placements, mesh)
        got = run_ours(opt, d_params, [_distribute(g, placements, mesh) for g in grads])
        assert all(isinstance(x, DTensor) for x in tree.leaves(got))
        assert [x.placements for x in tree.leaves(got)] == [x.placements for x in tree.leaves(d_params)]
        _assert_per_rank_close(got, expected)


@settings(max_examples=4)
@given(placement_trees, st.sampled_from([0.01, 0.1, 1.0, 100.0]))
def test_global_norm_and_clip_reduce_across_shards(placements, scale):
    grads = random_tree(SHAPES, 7, scale)
    expected, _ = optim.clip_by_global_norm(1.0).update(grads, optim.EmptyState())
    with shardings.simulate(4):
        d_grads = _distribute(grads, placements, Mesh(dp=2, tp=2).device_mesh)
        norm = optim.global_norm(d_grads)
        assert not isinstance(norm, DTensor)  # plain 0-d: scales plain and DTensor leaves alike
        for value in shardings.per_rank(norm):
            assert_close(value, optim.global_norm(grads))
        clipped, _ = optim.clip_by_global_norm(1.0).update(d_grads, optim.EmptyState())
        _assert_per_rank_close(clipped, expected)


def test_zero_sharded_state_with_replicated_params_matches_plain():
    """ZeRO-1/2 shape: params and grads replicated, Adam moments and momentum sharded on dp, count replicated."""
    opt = _optimizers()["clip_adamw"]
    params, grads = random_tree(SHAPES, 3), grad_sequence(SHAPES, 3, steps=3)
    expected = run_ours(opt, params, grads)
    replicated = tree.map(lambda p: (Replicate(), Replicate()), params)
    sharded = tree.map(lambda p: (Shard(0), Replicate()), params)
    with shardings.simulate(4):
        mesh = Mesh(dp=2, tp=2).device_mesh
        d_params = _distribute(params, replicated, mesh)
        clip_state, (adam, *rest) = opt.init(d_params)
        count = distribute_tensor(adam.count, mesh, [Replicate(), Replicate()])
        mu, nu = (tree.map(lambda m, pl: m.redistribute(mesh, list(pl)), s, sharded) for s in (adam.mu, adam.nu))
        state = (clip_state, (optim.ScaleByAdamState(count, mu, nu), *rest))
        for g in grads:
            updates, state = opt.update(_distribute(g, replicated, mesh), state, d_params)
            d_params = optim.apply_updates(d_params, updates)
        assert state[1][0].mu["w"].placements == (Shard(0), Replicate())
        _assert_per_rank_close(d_params, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizer_state_keeps_leaf_placements_and_dtype(dtype):
    params = random_tree(SHAPES, 5)
    with shardings.simulate(4):
        mesh = Mesh(dp=2, tp=2).device_mesh
        d_params = tree.map(lambda p: distribute_tensor(p.to(dtype), mesh, [Shard(0), Shard(1)]), params)
        adam, *_ = optim.adamw(1e-3).init(d_params)
        for m, p in zip(tree.leaves((adam.mu, adam.nu)), tree.leaves((d_params, d_params))):
            assert isinstance(m, DTensor) and m.placements == p.placements and m.dtype == dtype
