"""Ops a researcher's block calls that DTensor could not trace under ``train_step(jit=True)``, compiled on real ranks
(aot_eager) and compared with one device, both in one launch of 4 ranks (``Mesh(dp=2, tp=2)``, zero3+tp+sp):

- ``torch.einsum`` over 3-D weights (``"bshd,hde->bse"``, heads split on tp): its decomposition flattens ``(h, d)``
  as a ``_StridedShard``, and pricing its redistribution on a 2-D mesh made unbacked SymInts
  (``PendingUnbackedSymbolNotFound``; fixed in ``shardings.runtime.compat``: the planner's logical shape asks for no
  offsets). A 1-D mesh never priced it: a 2-D one is needed to see it.
- ``F.one_hot`` (a router's count of chosen experts): traced, it emits ``aten._assert_async``, which DTensor had no
  strategy for (:mod:`shardings.ops.assert_strategies`).
"""

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

import core
from shardings import Mesh, constrain
from shardings.pipeline import Stages
from shardings.testing import check_equivalences

pytestmark = pytest.mark.multiprocess

RESIDUAL = ("batch", "seq", "embed")
BLOCK_INPUT = ("batch", "block_seq", "embed")


@dataclasses.dataclass(frozen=True)
class Config:
    dim: int = 8
    heads: int = 2
    experts: int = 4
    one_hot: bool = False  # the block: einsum over 3-D weights, or a router counted with F.one_hot


def init(key, cfg):
    k1, k2, k3, k4 = core.random.split(key, 4)
    hd = cfg.dim // cfg.heads
    weights = ({"router": core.random.normal(k4, (cfg.dim, cfg.experts))} if cfg.one_hot else
               {"wq": core.random.normal(k2, (cfg.dim, cfg.heads, hd)) * 0.3,
                "wo": core.random.normal(k3, (cfg.heads, hd, cfg.dim)) * 0.3})
    return {"emb": core.random.normal(k1, (cfg.dim,)), "blocks": [weights]}


def axes(cfg):
    weights = ({"router": ("embed", None)} if cfg.one_hot else
               {"wq": ("embed", "heads", "head_dim"), "wo": ("heads", "head_dim", "embed")})
    return {"emb": ("embed",), "blocks": [weights]}


def block(p, x, cfg):
    h = constrain(x, BLOCK_INPUT)
    if cfg.one_hot:
        probs = F.softmax(h @ p["router"], dim=-1)  # (b, s, experts)
        chosen = F.one_hot(probs.topk(2, dim=-1).indices, cfg.experts).sum(2).float()  # (b, s, experts)
        return x + h * (chosen * probs).sum(-1, keepdim=True)
    q = torch.einsum("bse,ehd->bshd", h, p["wq"])
    return x + constrain(torch.einsum("bshd,hde->bse", q, p["wo"]), RESIDUAL)


def stages(cfg):
    return Stages(first=lambda params, batch: constrain(batch["x"] * params["emb"], RESIDUAL),
                  block=lambda p, x, i: block(p, x, cfg), last=lambda params, x, batch: (x ** 2).mean(),
                  carry_names=lambda x: RESIDUAL)


def loss(params, batch, cfg):
    return stages(cfg).loss(params, batch)


def test_einsum_over_3d_weights_and_one_hot_compile_on_a_2d_mesh_and_equal_one_device():
    batch = {"x": torch.randn(4, 4, Config.dim, generator=torch.Generator().manual_seed(0))}
    common = dict(init=init, loss=loss, axes=axes, batch=batch, layouts=["zero3+tp+sp"], mesh=Mesh(dp=2, tp=2),
                  stages=stages, steps=1, optimizer=functools.partial(core.optim.adamw, 1e-3), jit=True,
                  jit_backend="aot_eager")
    reports = check_equivalences({name: {**common, "cfg": Config(one_hot=one_hot)}
                                  for name, one_hot in (("einsum", False), ("one_hot", True))},
                                 raise_on_failure=False)
    for name, report in reports.items():
        assert report.ok, f"{name}:\n{report}"
