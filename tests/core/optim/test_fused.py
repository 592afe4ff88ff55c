"""``adamw(...).fused_step`` (torch's fused kernel, in place) equals the pure ``update`` + ``apply_updates``."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core import optim, tree
from core.optim.fused import fusable
from shardings import Mesh, shard, simulate
from tests.core.optim.helpers import assert_trees_close, grad_sequence, random_tree, tree_shapes


def _matrices(params):
    return tree.map(lambda p: p.ndim >= 2, params)


LEARNING_RATES = {"float": 1e-2, "tensor": torch.tensor(1e-2), "schedule": optim.warmup_cosine(1e-2, 2, 10)}


@settings(max_examples=15)
@given(shapes=tree_shapes, seed=st.integers(0, 2**16), lr=st.sampled_from(sorted(LEARNING_RATES)),
       weight_decay=st.sampled_from([0.0, 0.1]), masked=st.booleans(), steps=st.integers(1, 4))
def test_fused_step_equals_update_then_apply(shapes, seed, lr, weight_decay, masked, steps):
    opt = optim.adamw(LEARNING_RATES[lr], weight_decay=weight_decay, mask=_matrices if masked else None)
    params = random_tree(shapes, seed)
    pure, pure_state = params, opt.init(params)
    fused = tree.map(torch.clone, params)
    fused_state = opt.init(fused)
    for grads in grad_sequence(shapes, seed, steps):
        updates, pure_state = opt.update(grads, pure_state, pure)
        pure = optim.apply_updates(pure, updates)
        before = tree.leaves(fused)
        fused, fused_state = opt.fused_step(grads, fused_state, fused)
        assert all(a is b for a, b in zip(tree.leaves(fused), before))  # written in place
    # Rounding only: the kernel decays p by (1 - lr*wd) before the Adam step; the pure form adds wd*p.
    assert_trees_close(fused, pure)
    assert_trees_close(fused_state, pure_state)
    assert int(fused_state[0].count) == int(pure_state[0].count) == steps


def test_a_frozen_leaf_without_grad_is_left_alone():
    opt = optim.adamw(0.1)
    params = {"w": torch.ones(2), "frozen": torch.ones(2)}
    new, _ = opt.fused_step({"w": torch.ones(2), "frozen": None}, opt.init(params), params)
    assert torch.equal(new["frozen"], torch.ones(2)) and not torch.equal(new["w"], torch.ones(2))


def test_grads_laid_out_unlike_their_params_are_read_by_index_not_memory_order():
    """A transposed matmul's gradient (strides (1, n)) updates a contiguous parameter like a contiguous one."""
    opt = optim.adamw(1e-2)
    params = {"w": torch.randn(3, 5)}
    grads = {"w": torch.randn(5, 3).t()}  # same shape, transposed memory
    updates, _ = opt.update(grads, opt.init(params), params)
    want = optim.apply_updates(params, updates)
    got, _ = opt.fused_step(grads, opt.init(params), tree.map(torch.clone, params))
    assert_trees_close(got, want)


def test_fusable_means_plain_or_simulated_local_tensors():
    assert fusable({"w": torch.ones(2)}, (torch.zeros(1), None))
    with simulate(2):
        w = shard(torch.ones(2), None, Mesh(dp=2))
        assert fusable({"w": w.to_local()}) and not fusable({"w": w})


def test_chains_and_sgd_have_no_fused_step():
    assert optim.sgd(0.1).fused_step is None
    assert optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(0.1)).fused_step is None
