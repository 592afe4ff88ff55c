"""Two things the zoo's researchers' models (tests/zoo/) met under ``train_step(jit=True)`` on the DTensor path, each
checked against one device: a parameter the loss never uses (its gradient is zero, as on one device), eager and
compiled; and gpt2's written-out attention compiled by inductor (its ``_INDUCTOR_VIEW`` declaration, or the cells).

The unused leaf's model is a tiny MLP: its compiled step costs seconds, not the minutes of a transformer's.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

import core
from shardings import Mesh, constrain
from shardings.testing import check_equivalence

MESH = Mesh(dp=2, tp=2)
LAYOUT = "zero3+tp+sp"  # ZeRO-3's bucketed gathers on the DTensor path (shardings.residency.gather_buckets)


def init(key, cfg):
    k_in, k_out = core.random.split(key, 2)
    return {"w_in": core.random.normal(k_in, (cfg["dim"], cfg["mlp"])) * 0.3,
            "w_out": core.random.normal(k_out, (cfg["mlp"], cfg["dim"])) * 0.3,
            "spare": torch.ones(cfg["dim"]),  # never used by the loss: in the same ZeRO-3 bucket as the weights
            "spare_w": torch.ones(cfg["dim"], cfg["mlp"])}  # unused too, and split over tp as well


def axes(cfg):
    return {"w_in": ("embed", "mlp"), "w_out": ("mlp", "embed"), "spare": ("embed",), "spare_w": ("embed", "mlp")}


def loss(params, batch, cfg):
    x = constrain(batch["x"], ("batch", "seq", "embed"))  # (b, s, dim)
    h = F.gelu(x @ params["w_in"])  # (b, s, mlp)
    y = constrain(h @ params["w_out"], ("batch", "seq", "embed"))  # (b, s, dim)
    return ((y - batch["y"]) ** 2).mean()


CFG = {"dim": 8, "mlp": 16}


def _batch():
    gen = torch.Generator().manual_seed(0)
    return {"x": torch.randn(8, 4, CFG["dim"], generator=gen), "y": torch.randn(8, 4, CFG["dim"], generator=gen)}


ARGS = dict(init=init, loss=loss, axes=axes, cfg=CFG, batch=_batch(), layouts=[LAYOUT], mesh=MESH, steps=2,
            optimizer=functools.partial(core.optim.adamw, 1e-2))


def test_an_unused_parameter_under_zero3_tp_sp_trains_like_one_device():
    """Its gradient is zero and its update AdamW's weight decay alone, as on one device; before, the bucket's
    backward got autograd's materialized zeros (a plain tensor of the global shape) and raised ``'LocalTensor' object
    has no attribute 'placements'``."""
    report = check_equivalence(**ARGS, runtime="simulate")
    assert report.ok, str(report)


@pytest.mark.multiprocess
def test_an_unused_parameter_under_zero3_tp_sp_compiled_trains_like_one_device():
    """The same under ``jit=True`` on real ranks (the zoo's crash: ``'Tensor' object has no attribute
    'placements'``)."""
    report = check_equivalence(**ARGS, runtime="multiprocess", jit=True, jit_backend="aot_eager")
    assert report.ok, str(report)
