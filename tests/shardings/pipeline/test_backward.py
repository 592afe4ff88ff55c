"""shardings.pipeline.backward: B (input gradient) then W (weight gradient) is one whole backward, bitwise, and
W may run any time after its B: the executor's gradients do not move by a bit."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

from shardings import pipeline
from shardings.pipeline.backward import backward_input, backward_weight
from shardings.pipeline.schedule import Action
from tests.shardings.pipeline.cases import MODELS, split_after_b
from tests.shardings.pipeline.cases import microbatches as _microbatches
from tests.shardings.pipeline.cases import setup as _setup


def _run(schedule, model, layers, m, batch_rows=8):
    module, cfg, params, batch = _setup(model, layers, batch_rows)
    mbs, weights = _microbatches(batch, m)
    return pipeline.run(schedule, module.stages(cfg), pipeline.split(params, schedule.stages), params, mbs, weights)


def _assert_bitwise(got, want):
    assert torch.equal(got.loss, want.loss)
    for path, g, w in zip(*(pytree.tree_flatten_with_path(want.grads)[0],), pytree.tree_leaves(got.grads),
                          pytree.tree_leaves(want.grads)):
        assert torch.equal(g, w), pytree.keystr(path[0])


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("stage", ["first", "middle", "last"])
def test_b_then_w_is_the_whole_backward_bitwise(model, stage):
    module, cfg, params, batch = _setup(model, 3, 4)
    stages = module.stages(cfg)
    params = pytree.tree_map(lambda x: x.detach().requires_grad_(x.is_floating_point()), params)
    leaves = [x for x in pytree.tree_leaves(params) if x.requires_grad]
    carry = pytree.tree_map(lambda x: x.detach().requires_grad_(x.is_floating_point()), stages.first(params, batch))
    inputs = [] if stage == "first" else [x for x in pytree.tree_leaves(carry) if x.requires_grad]

    def forward():
        x = stages.first(params, batch) if stage == "first" else carry
        for i in range(3):
            x = stages.block(params["blocks"][i], x, i)
        return [stages.last(params, x, batch)] if stage == "last" else [t for t in pytree.tree_leaves(x)
                                                                       if t.requires_grad]

    outs = forward()
    cots = [torch.ones_like(o) if stage == "last" else torch.randn_like(o) for o in outs]
    whole = torch.autograd.grad(outs, inputs + leaves, cots, allow_unused=True)
    outs = forward()
    in_grads, pending = backward_input(outs, cots, inputs, leaves)
    del outs  # W needs only what B kept
    weight_grads = backward_weight(pending, leaves)
    for got, want in zip(list(in_grads) + weight_grads, whole):
        assert (got is None and want is None) or torch.equal(got, want)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_a_split_schedule_runs_bitwise_like_its_whole_backwards(model, name):
    whole = pipeline.build(name, 2, 4)
    _assert_bitwise(_run(split_after_b(whole), model, 3, 4), _run(whole, model, 3, 4))


def test_zero_bubble_schedules_give_the_bits_of_1f1b_and_interleaved():
    """Gradients are summed in microbatch order per stage whatever the order of W: same split, same bits."""
    _assert_bitwise(_run(pipeline.build("zb_h1", 2, 4), "gpt", 4, 4), _run(pipeline.build("1f1b", 2, 4), "gpt", 4, 4))
    _assert_bitwise(_run(pipeline.build("zb_v", 2, 4), "gpt", 4, 4),
                    _run(pipeline.build("interleaved_1f1b", 2, 4), "gpt", 4, 4))


@settings(max_examples=10, deadline=None)
@given(pp=st.integers(1, 3), m=st.integers(1, 4), data=st.data())
def test_w_may_run_anywhere_after_its_b(pp, m, data):
    """Move every W of 1F1B-split to a random place after its B on its rank: it checks, and the bits stay."""
    split = split_after_b(pipeline.build("1f1b", pp, m))
    ranks = []
    for actions in split.ranks:
        rest = [a for a in actions if a.kind != "W"]
        for w in [a for a in actions if a.kind == "W"]:
            after = rest.index(Action("B", w.stage, w.mb)) + 1
            rest.insert(data.draw(st.integers(after, len(rest)), label=f"place of {w}@{w.stage}"), w)
        ranks.append(tuple(rest))
    moved = dataclasses.replace(split, ranks=tuple(ranks))
    pipeline.check(moved)
    _assert_bitwise(_run(moved, "gpt", pp, m), _run(pipeline.build("1f1b", pp, m), "gpt", pp, m))
