"""A step without a loss scale whose gradients are not finite raises ``NonFiniteGradError`` naming the first leaf
(``shardings/step/finite.py``), under data, tensor and ZeRO layouts on simulated ranks, in fp32 and under bf16;
under fp16 the loss scale skips the step instead."""

import functools

import pytest
import torch

import core
import shardings
from core.precision import Policy
from models import mlp
from shardings import Mesh

CFG = mlp.Config(dim=16, mlp=32, layers=2, seq_len=8)
BATCH = mlp.example_batch(CFG, 4)


def _poisoned_loss(params, batch, leaves):
    """mlp's loss with the gradients of ``leaves`` (``(block, name)``) NaN: each enters the loss once more, times
    NaN, times 0."""
    extra = sum((params["blocks"][b][name] * float("nan")).sum() * 0.0 for b, name in leaves)
    return mlp.loss(params, batch, CFG) + extra


def _step(layout, mesh, leaves, precision=None):
    params = shardings.init(mlp.init, core.random.key(0), CFG, axes=mlp.axes(CFG), layout=layout, mesh=mesh)
    step = shardings.train_step(functools.partial(_poisoned_loss, leaves=leaves), core.optim.sgd(0.1), layout=layout,
                                mesh=mesh, axes=mlp.axes(CFG), clip_norm=1.0, precision=precision)
    return step, params, step.init(params)


@pytest.mark.parametrize(("layout", "mesh", "precision"), [
    ("dp", Mesh(dp=2), None), ("dp+tp", Mesh(dp=2, tp=2), None), ("zero2", Mesh(dp=2), None),
    ("zero2", Mesh(dp=2), Policy.bf16_mixed()), ("dp+tp", Mesh(dp=2, tp=2), Policy.bf16_mixed()),  # no loss scale
])
def test_a_non_finite_gradient_names_its_first_leaf(layout, mesh, precision):
    with shardings.simulate(mesh.size):
        step, params, state = _step(layout, mesh, [(1, "w_down"), (1, "w_up")], precision)  # tree order: w_up first
        with pytest.raises(shardings.NonFiniteGradError, match=r"the gradient of \['blocks'\]\[1\]\['w_up'\]") as e:
            step(params, state, BATCH)
        assert e.value.path == "['blocks'][1]['w_up']" and "Fix:" in str(e.value)
        assert "at step 7:" in str(e.value.at_step(7))


def test_fp16_skips_the_step_and_counts_it_instead():
    mesh = Mesh(dp=2)
    with shardings.simulate(2):
        step, params, state = _step("zero2", mesh, [(0, "w_down")], precision=Policy.fp16_mixed())
        new_params, new_state, _ = step(params, state, BATCH)
        assert int(shardings.unwrap(new_state.loss_scale.skipped)) == 1
        same = [torch.equal(shardings.unwrap(a.full_tensor()), shardings.unwrap(b.full_tensor()))
                for a, b in zip(core.tree.leaves(params), core.tree.leaves(new_params))]
        assert all(same)
