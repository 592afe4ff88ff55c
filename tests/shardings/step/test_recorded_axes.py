"""A new user's own model: logical names with ``None`` (a dim deliberately kept whole) train without ``axes=``."""

import functools

import pytest

import core
import models.mlp as mlp
import shardings
from core import tree
from shardings import Mesh, P

CFG = mlp.Config(vocab=32, dim=16, mlp=32, layers=2, seq_len=8)


def _axes_with_replicated_dims(cfg):
    """mlp's names, but each block's up projection keeps its input dim whole on purpose: ``(None, "mlp")``."""
    axes = mlp.axes(cfg)
    for block in axes["blocks"]:
        block["w_up"] = (None, "mlp")
    return axes


@pytest.mark.parametrize("layout", ["zero3+tp", "dp"])
def test_train_step_reads_the_names_init_recorded_even_with_none_dims(layout):
    mesh, axes, batch = Mesh(dp=2, tp=2), _axes_with_replicated_dims(CFG), mlp.example_batch(CFG, 4)
    losses = {}
    with shardings.simulate(mesh.size):
        for given in (axes, None):  # None: train_step reads what shardings.init recorded
            params = shardings.init(mlp.init, core.random.key(0), CFG, axes=axes, layout=layout, mesh=mesh)
            step = shardings.train_step(functools.partial(mlp.loss, cfg=CFG), core.optim.sgd(0.1), layout=layout,
                                        mesh=mesh, axes=given)
            specs = step.plan(params).specs["params"]
            _, _, metrics = step(params, step.init(params), batch)
            losses[given is None] = metrics["loss"]
    assert specs["blocks"][0]["w_up"][0] is None  # the None dim stays whole in storage
    assert losses[True] == losses[False]


def test_params_without_recorded_names_still_ask_for_axes():
    mesh = Mesh(dp=2)
    with shardings.simulate(mesh.size):
        params = tree.map(lambda x: shardings.shard(x, P(), mesh), mlp.init(core.random.key(0), CFG))
        step = shardings.train_step(functools.partial(mlp.loss, cfg=CFG), core.optim.sgd(0.1), layout="dp", mesh=mesh)
        with pytest.raises(TypeError, match=r"cannot tell the logical axes.*Fix: pass axes="):
            step.init(params)
