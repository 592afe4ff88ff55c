"""``sgd`` and ``adamw`` reproduce ``torch.optim.SGD`` / ``torch.optim.AdamW`` over 10 steps."""

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from core import optim, tree
from tests.core.optim.helpers import assert_trees_close, grad_sequence, random_tree, run_ours, run_torch, tree_shapes

lrs = st.floats(1e-4, 0.3)
seeds = st.integers(0, 2**16)


@given(tree_shapes, seeds, lrs, st.sampled_from([0.0, 0.5, 0.9]), st.booleans(), st.sampled_from([0.0, 1e-2, 0.1]))
def test_sgd_matches_torch(shapes, seed, lr, momentum, nesterov, weight_decay):
    nesterov = nesterov and momentum > 0
    params, grads = random_tree(shapes, seed), grad_sequence(shapes, seed)
    ours = run_ours(optim.sgd(lr, momentum, nesterov, weight_decay), params, grads)
    expected = run_torch(
        lambda ps: torch.optim.SGD(ps, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay),
        params,
        grads,
    )
    steepest = sum(max(float(g.abs().max()) for g in tree.leaves(gs)) for gs in grads)
    assert_trees_close(ours, expected, start=params, moved=lr * steepest / (1 - momentum) * (1 + weight_decay))


adam_hparams = st.fixed_dictionaries(
    {
        "lr": lrs,
        "b1": st.floats(0.5, 0.99),
        "b2": st.floats(0.9, 0.9999),
        "eps": st.sampled_from([1e-8, 1e-6, 1e-3]),
        "weight_decay": st.sampled_from([0.0, 0.01, 0.1]),
    }
)


@given(tree_shapes, seeds, adam_hparams)
@example(  # make test-explore: one-entry leaves that end near zero after ten steps of ±lr (1.5e-7 apart)
    {"w0": (1,), "blocks": [(1,)]}, 12914, {"lr": 0.1796875, "b1": 0.5, "b2": 0.9375, "eps": 1e-8, "weight_decay": 0.1}
)
def test_adamw_matches_torch(shapes, seed, h):
    params, grads = random_tree(shapes, seed), grad_sequence(shapes, seed)
    ours = run_ours(optim.adamw(h["lr"], h["b1"], h["b2"], h["eps"], h["weight_decay"]), params, grads)
    expected = run_torch(
        lambda ps: torch.optim.AdamW(
            ps, lr=h["lr"], betas=(h["b1"], h["b2"]), eps=h["eps"], weight_decay=h["weight_decay"]
        ),
        params,
        grads,
    )
    assert_trees_close(ours, expected, start=params, moved=h["lr"] * len(grads))


@given(tree_shapes, seeds, adam_hparams, st.booleans())
def test_adamw_mask_matches_torch_param_groups(shapes, seed, h, mask_as_fn):
    params, grads = random_tree(shapes, seed), grad_sequence(shapes, seed)
    decays = tree.map(lambda p: p.ndim >= 2, params)
    mask = (lambda ps: tree.map(lambda p: p.ndim >= 2, ps)) if mask_as_fn else decays
    ours = run_ours(optim.adamw(h["lr"], h["b1"], h["b2"], h["eps"], 0.1, mask=mask), params, grads)

    def torch_adamw(ps):
        flags = tree.leaves(decays)
        groups = [
            {"params": [p for p, d in zip(ps, flags) if d], "weight_decay": 0.1},
            {"params": [p for p, d in zip(ps, flags) if not d], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=h["lr"], betas=(h["b1"], h["b2"]), eps=h["eps"])

    assert_trees_close(ours, run_torch(torch_adamw, params, grads), start=params, moved=h["lr"] * len(grads))


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (lambda lr: optim.sgd(lr, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.0, momentum=0.9)),
        (lambda lr: optim.adamw(lr, weight_decay=0.1), lambda ps: torch.optim.AdamW(ps, lr=0.0, weight_decay=0.1)),
    ],
    ids=["sgd", "adamw"],
)
def test_learning_rate_schedule_matches_torch_with_per_step_lr(ours, theirs):
    """Step ``i`` (from 0) uses ``schedule(i)``, both for the update and for AdamW's decay term."""
    shapes = {"w": (3, 2), "blocks": [(4,)]}
    params, grads = random_tree(shapes, 0), grad_sequence(shapes, 0)
    schedule = optim.warmup_cosine(0.1, warmup_steps=3, decay_steps=8, end=0.01, init=0.02)

    def set_lr(ps, opt, i):
        for group in opt.param_groups:
            group["lr"] = float(schedule(i))

    assert_trees_close(run_ours(ours(schedule), params, grads), run_torch(theirs, params, grads, before_step=set_lr))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: optim.sgd(0.1, nesterov=True), "nesterov"),
        (lambda: optim.sgd(0.1, momentum=-0.1), "momentum"),
        (lambda: optim.adamw(0.1, b1=1.0), "b1"),
        (lambda: optim.adamw(0.1, b2=-0.5), "b2"),
        (lambda: optim.adamw(0.1, eps=-1.0), "eps"),
        (lambda: optim.adamw(0.1, weight_decay=-1.0), "weight_decay"),
    ],
)
def test_bad_hyperparameters_raise_with_fix(make, match):
    with pytest.raises(ValueError, match=rf"{match}.*Fix: "):
        make()
