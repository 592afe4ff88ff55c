"""A ``torch.autograd.Function`` applied to a parameter under ZeRO-3: ``apply()`` does not go through torch functions,
so it takes the placeholder ungathered (:mod:`shardings.residency.lazy_params`) and its gradient would be lost without
a word. The step raises instead, naming the leaf and the fix (``shardings.resolve``); with the fix it equals one
device. Both gradient paths (the local one: ``zero3``; the DTensor one: ``zero3+tp``), a bf16 policy (whose cast keeps
the placeholder) and real processes."""

import functools

import pytest
import torch

import core
import shardings
from core.precision import Policy
from shardings import Mesh, ShardingError
from shardings.testing import check_equivalence

PATHS = [("zero3", Mesh(dp=2)), ("zero3+tp", Mesh(dp=2, tp=2))]
BF16 = Policy.bf16_mixed()


class _Identity(torch.autograd.Function):
    """A custom op's autograd (here the identity), as models write them for fused kernels."""

    @staticmethod
    def forward(ctx, w):
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        return g


def init(key, cfg):
    k1, k2 = core.random.split(key, 2)
    return {"blocks": [{"w": core.random.normal(k1, (8, 8)) * 0.3}, {"w": core.random.normal(k2, (8, 8)) * 0.3}]}


def axes(cfg):
    return {"blocks": [{"w": ("embed", "mlp")}, {"w": ("embed", "mlp")}]}


def loss(params, batch, cfg):
    w0 = params["blocks"][0]["w"]
    x = torch.tanh(batch["x"].to(w0.dtype) @ _Identity.apply(shardings.resolve(w0) if cfg["resolve"] else w0))
    x = torch.tanh(x @ params["blocks"][1]["w"])
    return ((x.float() - batch["y"]) ** 2).mean()


def _check(layout, mesh, resolve, **kw):
    gen = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(8, 8, generator=gen), "y": torch.randn(8, 8, generator=gen)}
    return check_equivalence(init, loss, axes, {"resolve": resolve}, batch, layouts=[layout], mesh=mesh, steps=2,
                             optimizer=functools.partial(core.optim.adamw, 1e-2), **kw)


@pytest.mark.parametrize(("layout", "mesh"), PATHS, ids=[p[0] for p in PATHS])
@pytest.mark.parametrize("precision", [None, BF16], ids=["fp32", "bf16"])
def test_a_function_given_the_placeholder_raises_naming_the_leaf_and_the_fix(layout, mesh, precision):
    with pytest.raises(ShardingError, match=r"at \['blocks'\]\[0\]\['w'\].*gradient would be lost.*shardings\.resolve"):
        _check(layout, mesh, resolve=False, precision=precision)


@pytest.mark.parametrize(("layout", "mesh"), PATHS, ids=[p[0] for p in PATHS])
def test_given_the_resolved_weight_it_equals_one_device(layout, mesh):
    report = _check(layout, mesh, resolve=True)
    assert report.ok, str(report)


@pytest.mark.multiprocess
def test_real_processes_raise_it_too():
    with pytest.raises(Exception, match=r"\['blocks'\]\[0\]\['w'\].*gradient would be lost"):
        _check("zero3+tp", Mesh(dp=2, tp=2), resolve=False, runtime="multiprocess")
