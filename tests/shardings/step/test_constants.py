"""Constants mix with sharded tensors, as in JAX (#29 item 6): a causal mask made with ``torch.ones(s, s).triu(1)``
and position ids made with ``torch.arange`` inside the loss are plain tensors; where they meet a sharded tensor they
are taken as replicated on the active mesh, on every path (local, DTensor, pipeline stages). The model below makes
no sharding call at all, and equals one device under tp, tp+sp, zero3+tp, dp+pp and zero3."""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import core
from shardings import Mesh
from shardings.pipeline import Stages
from shardings.testing import check_equivalence


@dataclass(frozen=True)
class Config:
    vocab: int = 32
    dim: int = 16
    hidden: int = 16  # the attention's width (one head): "mlp", so tp splits it
    layers: int = 2
    seq_len: int = 8


def init(key, cfg):
    keys = iter(core.random.split(key, 3 + 3 * cfg.layers))

    def draw(*shape):
        return core.random.normal(next(keys), shape) * 0.2

    block = lambda: {"wqk": draw(cfg.dim, 2 * cfg.hidden), "wv": draw(cfg.dim, cfg.hidden),
                     "wo": draw(cfg.hidden, cfg.dim)}
    return {"tok": draw(cfg.vocab, cfg.dim), "pos": draw(cfg.seq_len, cfg.dim),
            "blocks": [block() for _ in range(cfg.layers)], "unembed": draw(cfg.dim, cfg.vocab)}


def axes(cfg):
    block = {"wqk": ("embed", "mlp"), "wv": ("embed", "mlp"), "wo": ("mlp", "embed")}
    return {"tok": ("vocab", "embed"), "pos": (None, "embed"), "blocks": [dict(block) for _ in range(cfg.layers)],
            "unembed": ("embed", "vocab")}


def embed(params, batch):
    s = batch["tokens"].shape[1]
    positions = torch.arange(s)  # a plain tensor made inside the loss
    return F.embedding(batch["tokens"], params["tok"]) + F.embedding(positions, params["pos"])


def block(p, x, cfg):
    s = x.shape[1]
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)  # the causal mask: a plain tensor made inside the loss
    q, k = (x @ p["wqk"]).chunk(2, dim=-1)
    scores = (q @ k.transpose(1, 2)).masked_fill(mask, float("-inf")) / cfg.hidden ** 0.5
    return x + (scores.softmax(-1) @ (x @ p["wv"])) @ p["wo"]


def head_loss(params, x, batch):
    logits = torch.tanh(x) @ params["unembed"]
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def stages(cfg):
    return Stages(first=embed, block=lambda p, x, i: block(p, x, cfg), last=head_loss,
                  carry_names=lambda x: ("batch", "seq", "embed"))


def loss(params, batch, cfg):
    return stages(cfg).loss(params, batch)


def example_batch(cfg, batch_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (batch_size, cfg.seq_len + 1), generator=g)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


CFG = Config()
BATCH = example_batch(CFG, 4)


@pytest.mark.parametrize(("layout", "mesh"), [
    ("tp", Mesh(tp=2)),
    ("tp+sp", Mesh(tp=2)),
    ("zero3+tp", Mesh(dp=2, tp=2)),
    ("zero3", Mesh(dp=2)),  # the local path: the loss runs on each rank's own tensors
    ("dp+pp", Mesh(dp=2, pp=2)),
])
def test_a_model_that_makes_its_mask_and_positions_as_plain_tensors_equals_one_device(layout, mesh):
    pipelined = "pp" in layout
    check_equivalence(init, loss, axes, CFG, BATCH, layouts=[layout], mesh=mesh, steps=2,
                      stages=stages if pipelined else None, accum_steps=2 if pipelined else 1)
