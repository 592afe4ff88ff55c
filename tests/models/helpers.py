"""Checks every reference model must pass, shared by the per-model test files."""

from types import ModuleType
from typing import Any

import torch
from hypothesis import strategies as st

import core
import shardings
from core import tree
from shardings.testing import assert_close


def assert_init_is_block_evaluable(model: ModuleType, cfg: Any, data: st.DataObject) -> None:
    """Every leaf is a deferred recipe (one draw or constant, then scalar arithmetic), so a sharded
    init can compute just its block, and any block equals that slice of the single-device init."""
    params = model.init(core.random.key(3), cfg)
    with core.deferred.deferred():
        recipes = model.init(core.random.key(3), cfg)
    for p, r in zip(tree.leaves(params), tree.leaves(recipes), strict=True):
        assert isinstance(r, core.deferred.Deferred) and r.shape == p.shape
        starts = [data.draw(st.integers(0, n - 1)) for n in p.shape]
        block = tuple(slice(a, data.draw(st.integers(a + 1, n))) for a, n in zip(starts, p.shape))
        assert torch.equal(r.block(block), p[block])


def sharded_loss_and_grads(model: ModuleType, cfg: Any, params: Any, batch: Any, rules: shardings.Rules):
    """Loss and grads of ``model`` with params sharded by ``rules`` over ``Mesh(tp=2)``, as plain tensors.

    Returns the sharded params too (rank 0's view of their layout is what tests inspect).
    """
    with shardings.simulate(2):
        mesh = shardings.Mesh(tp=2)
        sharded = shardings.shard(params, shardings.logical_to_specs(model.axes(cfg), rules, mesh), mesh)
        specs = shardings.spec_of(sharded)
        with shardings.use(mesh, rules):
            value, grads = core.value_and_grad(model.loss)(sharded, batch, cfg)
        value = shardings.per_rank(shardings.gather(value))[0]
        grads = tree.map(lambda g: shardings.per_rank(g)[0], shardings.gather(grads))
    return value, grads, specs


def assert_tensor_parallel_matches(model: ModuleType, cfg: Any, params: Any, batch: Any, rules: shardings.Rules):
    """The same model code on DTensors gives the single-device loss and grads (shardings.testing's tolerance rule)."""
    ref, ref_grads = core.value_and_grad(model.loss)(params, batch, cfg)
    value, grads, specs = sharded_loss_and_grads(model, cfg, params, batch, rules)
    assert_close(value, ref)
    for a, b in zip(tree.leaves(grads), tree.leaves(ref_grads)):
        assert_close(a, b)
    return specs
