"""Two things the zoo's researchers' models (tests/zoo/) met under ``train_step(jit=True)`` on the DTensor path, each
checked against one device: a parameter the loss never uses (its gradient is zero, as on one device), eager and
compiled; and attention written out with ``torch.cat`` of one tensor, compiled by inductor, whose decomposition laid
the local block out otherwise than DTensor recorded (:mod:`shardings.ops.compile_decompositions`: gpt2's "Cannot
view a tensor with shape" under zero3+tp).

The model is a tiny attention layer with unused leaves: its compiled step costs seconds, not a transformer's minutes.
"""

import functools

import pytest
import torch
from torch._inductor.decomposition import select_decomp_table

import core
from shardings import Mesh, constrain
from shardings.ops.compile_decompositions import cat
from shardings.testing import check_equivalence

MESH = Mesh(dp=2, tp=2)
LAYOUT = "zero3+tp+sp"  # ZeRO-3's bucketed gathers on the DTensor path (shardings.residency.gather_buckets)
CFG = {"dim": 8, "heads": 4, "head_dim": 4}


def init(key, cfg):
    kq, kk, ko = core.random.split(key, 3)
    qkv = (cfg["dim"], cfg["heads"], cfg["head_dim"])
    return {"q_w": core.random.normal(kq, qkv) * 0.3, "k_w": core.random.normal(kk, qkv) * 0.3,
            "o_w": core.random.normal(ko, (cfg["heads"], cfg["head_dim"], cfg["dim"])) * 0.3,
            "spare": torch.ones(cfg["dim"]),  # never used by the loss: in a ZeRO-3 bucket with the weights
            "spare_w": torch.ones(cfg["dim"], cfg["heads"], cfg["head_dim"])}  # unused too, split over tp as well


def axes(cfg):
    qkv = ("embed", "heads", "head_dim")
    return {"q_w": qkv, "k_w": qkv, "o_w": ("heads", "head_dim", "embed"), "spare": ("embed",), "spare_w": qkv}


def loss(params, batch, cfg):
    x = constrain(batch["x"], ("batch", "block_seq", "embed"))  # (b, s, dim), whole sequences on each tp rank
    q = torch.einsum("bse,ehd->bhsd", x, params["q_w"])  # (b, heads, s, hd), laid out (b, s, heads, hd)
    k = torch.einsum("bse,ehd->bhsd", x, params["k_w"])
    keys = torch.cat([k], dim=2)  # one tensor: a KV cache of no past, as gpt2's prefix_block writes it
    att = torch.softmax(q @ keys.transpose(-2, -1), dim=-1)  # (b, heads, s, s)
    y = constrain(torch.einsum("bhsd,hde->bse", att @ q, params["o_w"]), ("batch", "seq", "embed"))
    return ((y - batch["y"]) ** 2).mean()


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


def test_inductors_cat_of_one_tensor_is_laid_out_as_aten_cat():
    """The decomposition train_step's inductor uses gives ``aten.cat``'s layout (and values); inductor's own keeps a
    permuted input's strides, which is what DTensor's local block met (when that assertion fails, torch fixed it and
    shardings.ops.compile_decompositions can go)."""
    inductors = select_decomp_table()[torch.ops.aten.cat.default]
    k = torch.randn(4, 8, 2, 8).permute(0, 2, 1, 3)  # (b, h, s, d) laid out (b, s, h, d): einsum's bse,ehd->bhsd
    want = torch.cat([k], dim=2)
    assert inductors([k], 2).stride() != want.stride()
    got = cat(inductors, [k], 2)
    assert got.stride() == want.stride() and torch.equal(got, want)
    pair = cat(inductors, [k, k], 2)  # two tensors: inductor's decomposition as it is
    assert pair.stride() == torch.cat([k, k], dim=2).stride() and torch.equal(pair, torch.cat([k, k], dim=2))


@pytest.mark.multiprocess
def test_the_layer_compiled_by_inductor_with_unused_parameters_trains_like_one_device():
    """Both under ``jit=True`` on real ranks, compiled by inductor (the default backend): the zoo's crash
    (``'Tensor' object has no attribute 'placements'``) and gpt2's ("Cannot view a tensor with shape
    torch.Size([4, 2, 8, 8]) and strides (128, 8, 1, 16) as a tensor with shape (8, 8, 8)")."""
    report = check_equivalence(**ARGS, runtime="multiprocess", jit=True, jit_backend="inductor")
    assert report.ok, str(report)
