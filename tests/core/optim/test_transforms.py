"""Building blocks: clipping equals ``clip_grad_norm_``, chain composes, masks and errors, purity, tracing."""

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from core import optim, tree
from shardings.testing import assert_close
from tests.core.optim.helpers import assert_trees_close, grad_sequence, random_tree, run_ours, run_torch, tree_shapes

seeds = st.integers(0, 2**16)
# Gradient scales and max norms spread so that some cases clip and some do not.
grad_scales = st.sampled_from([1e-3, 0.1, 1.0, 10.0])
max_norms = st.floats(0.05, 5.0)


@given(tree_shapes, seeds, grad_scales, max_norms)
def test_clip_by_global_norm_matches_clip_grad_norm(shapes, seed, scale, max_norm):
    grads = random_tree(shapes, seed, scale)
    clipped, _ = optim.clip_by_global_norm(max_norm).update(grads, optim.EmptyState())
    ps = [torch.zeros_like(g, requires_grad=True) for g in tree.leaves(grads)]
    for p, g in zip(ps, tree.leaves(grads)):
        p.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(ps, max_norm)
    assert_trees_close(clipped, tree.unflatten(tree.structure(grads), [p.grad for p in ps]))
    assert_close(optim.global_norm(grads), total)


@given(tree_shapes, seeds, grad_scales, max_norms, st.floats(1e-4, 0.1))
def test_chain_clip_adamw_matches_clip_grad_norm_then_adamw(shapes, seed, scale, max_norm, lr):
    params, grads = random_tree(shapes, seed), grad_sequence(shapes, seed, scale=scale)
    opt = optim.chain(optim.clip_by_global_norm(max_norm), optim.adamw(lr, weight_decay=0.1))
    expected = run_torch(
        lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.1),
        params,
        grads,
        before_step=lambda ps, opt, i: torch.nn.utils.clip_grad_norm_(ps, max_norm),
    )
    assert_trees_close(run_ours(opt, params, grads), expected)


def test_global_norm_ignores_non_tensor_leaves_and_upcasts():
    grads = {"a": torch.tensor([3.0], dtype=torch.bfloat16), "b": None, "c": [torch.tensor([4.0])], "n": 7}
    norm = optim.global_norm(grads)
    assert norm.dtype == torch.float32 and norm.ndim == 0
    assert_close(norm, torch.tensor(5.0))
    big = {"h": torch.full((4,), 6e4, dtype=torch.float16)}  # squares overflow float16
    assert_close(optim.global_norm(big), torch.tensor(1.2e5))
    assert_close(optim.global_norm({"none": None}), torch.tensor(0.0))


def test_none_updates_pass_through_and_keep_params():
    params = {"w": torch.ones(2), "step": 3}
    grads = {"w": torch.ones(2), "step": None}
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(0.1))
    updates, _ = opt.update(grads, opt.init(params), params)
    assert updates["step"] is None
    assert optim.apply_updates(params, updates)["step"] == 3


def test_apply_updates_keeps_param_dtype():
    params = {"w": torch.ones(2, dtype=torch.bfloat16)}
    out = optim.apply_updates(params, {"w": torch.full((2,), -0.5)})
    assert out["w"].dtype == torch.bfloat16
    assert_close(out["w"], torch.full((2,), 0.5, dtype=torch.bfloat16))


def test_state_is_namedtuple_pytree_mirroring_params():
    params = {"w": torch.ones(2, 3), "blocks": [torch.ones(4)]}
    adam_state, *_ = optim.adamw(1e-3).init(params)
    assert isinstance(adam_state, optim.ScaleByAdamState)
    assert adam_state.count.dtype == torch.int32 and adam_state.count.ndim == 0
    assert tree.structure(adam_state.mu) == tree.structure(params) == tree.structure(adam_state.nu)
    assert all(torch.equal(m, torch.zeros_like(p)) for m, p in zip(tree.leaves(adam_state.mu), tree.leaves(params)))


def test_scale_by_schedule_counts_from_zero():
    opt = optim.scale_by_schedule(lambda count: count.to(torch.float32) + 1)
    state = opt.init({"w": torch.ones(1)})
    outs = []
    for _ in range(3):
        u, state = opt.update({"w": torch.ones(1)}, state)
        outs.append(u["w"].item())
    assert outs == [1.0, 2.0, 3.0]
    assert state.count.item() == 3


OPTIMIZERS = {
    "sgd": optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adamw_mask": optim.adamw(optim.warmup_cosine(0.1, 2, 10), mask=lambda p: tree.map(lambda x: x.ndim > 1, p)),
    "clip_adamw": optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(0.1, weight_decay=0.1)),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_update_is_pure(name):
    """Neither params, grads nor state are mutated, over several steps (state tensors included)."""
    opt = OPTIMIZERS[name]
    shapes = {"w": (3, 2), "blocks": [(4,), (2, 2)]}
    params = random_tree(shapes, 1)
    state = opt.init(params)
    for grads in grad_sequence(shapes, 1, steps=3):
        before = copy.deepcopy((params, grads, state))
        updates, new_state = opt.update(grads, state, params)
        new_params = optim.apply_updates(params, updates)
        for a, b in zip(tree.leaves((params, grads, state)), tree.leaves(before)):
            assert torch.equal(a, b)
        params, state = new_params, new_state


def test_update_traces_without_graph_breaks():
    """No ``.item()`` and no Python branch on tensor values: dynamo captures one graph."""
    opt = OPTIMIZERS["clip_adamw"]
    params = random_tree({"w": (3, 2), "b": (4,)}, 2)
    grads = random_tree({"w": (3, 2), "b": (4,)}, 3)
    state = opt.init(params)
    compiled = torch.compile(opt.update, backend="eager", fullgraph=True)
    assert_trees_close(compiled(grads, state, params), opt.update(grads, state, params))


def test_weight_decay_mask_errors_name_the_problem_and_fix():
    params = {"w": torch.ones(2), "b": torch.ones(2)}
    grads = tree.map(torch.ones_like, params)
    with pytest.raises(ValueError, match=r"mask does not match.*without a mask entry: \['b'\]; .*Fix: "):
        optim.adamw(0.1, mask={"w": True}).update(grads, optim.adamw(0.1).init(params), params)
    with pytest.raises(TypeError, match=r"mask at \['b'\]: expected a bool, got Tensor.*Fix: "):
        optim.add_decayed_weights(0.1, mask={"w": True, "b": torch.tensor(True)}).update(grads, (), params)
    with pytest.raises(ValueError, match=r"needs the params.*Fix: "):
        optim.add_decayed_weights(0.1).update(grads, ())


def test_chain_rejects_foreign_state_and_clip_rejects_bad_norm():
    opt = optim.chain(optim.scale(1.0), optim.scale(2.0))
    with pytest.raises(ValueError, match=r"got a state with 1 entries.*Fix: "):
        opt.update({"w": torch.ones(1)}, (optim.EmptyState(),))
    with pytest.raises(ValueError, match=r"max_norm must be > 0.*Fix: "):
        optim.clip_by_global_norm(0.0)
