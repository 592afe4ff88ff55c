"""A gated convolutional language model (Dauphin et al. 2017's GLU blocks, the mixer of H3/Hyena's family): no
attention anywhere. Each block mixes tokens with a causal depthwise convolution written as shifted copies
(``F.pad`` then a slice), gated by a sigmoid branch, then a channel MLP. Nothing of ``models/``."""

import dataclasses
import functools

import torch
import torch.nn.functional as F

import core
from shardings import constrain
from shardings.pipeline import Stages

RESIDUAL = ("batch", "seq", "embed")
BLOCK_INPUT = ("batch", "block_seq", "embed")


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256  # token ids ("vocab"): bytes, what experiments.train feeds
    seq_len: int = 8
    dim: int = 32  # residual width ("embed")
    width: int = 64  # the gated branch's channels ("mlp")
    kernel: int = 3  # causal convolution taps: token t sees t, t-1, t-2
    layers: int = 2


def init(key, cfg):
    normal = lambda k, *shape: core.random.normal(k, shape) * shape[0] ** -0.5
    k_tok, k_head, k_blocks = core.random.split(key, 3)
    blocks = []
    for i in range(cfg.layers):
        ku, kg, kc, ko, k1, k2 = core.random.split(core.random.fold_in(k_blocks, i), 6)
        blocks.append({
            "norm1": torch.ones(cfg.dim), "w_u": normal(ku, cfg.dim, cfg.width), "w_g": normal(kg, cfg.dim, cfg.width),
            "conv": normal(kc, cfg.kernel, cfg.width), "w_o": normal(ko, cfg.width, cfg.dim),
            "norm2": torch.ones(cfg.dim), "w1": normal(k1, cfg.dim, cfg.width), "w2": normal(k2, cfg.width, cfg.dim),
        })
    return {"tok": core.random.normal(k_tok, (cfg.vocab, cfg.dim)) * 0.02, "blocks": blocks,
            "norm": torch.ones(cfg.dim), "head": normal(k_head, cfg.dim, cfg.vocab)}


def axes(cfg):
    block = {"norm1": ("embed",), "w_u": ("embed", "mlp"), "w_g": ("embed", "mlp"), "conv": (None, "mlp"),
             "w_o": ("mlp", "embed"), "norm2": ("embed",), "w1": ("embed", "mlp"), "w2": ("mlp", "embed")}
    return {"tok": ("vocab", "embed"), "blocks": [dict(block) for _ in range(cfg.layers)], "norm": ("embed",),
            "head": ("embed", "vocab")}


def rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def causal_conv(u, taps):
    """Depthwise causal convolution of ``u: (b, s, c)`` with ``taps: (k, c)``: ``out[t] = Σ_j taps[j] u[t - j]``."""
    s = u.shape[1]
    return sum(F.pad(u, (0, 0, j, 0))[:, :s] * taps[j] for j in range(taps.shape[0]))  # (b, s, c)


def embed(params, batch):
    return constrain(F.embedding(constrain(batch["tokens"], ("batch", "seq")), params["tok"]), RESIDUAL)


def block(p, x, cfg):
    h = constrain(rms_norm(x, p["norm1"]), BLOCK_INPUT)
    mixed = causal_conv(h @ p["w_u"], p["conv"]) * torch.sigmoid(h @ p["w_g"])  # (b, s, width)
    x = x + constrain(mixed @ p["w_o"], RESIDUAL)
    h = constrain(rms_norm(x, p["norm2"]), BLOCK_INPUT)
    return x + constrain(F.gelu(h @ p["w1"]) @ p["w2"], RESIDUAL)


def head_loss(params, x, batch, cfg):
    logits = rms_norm(x, params["norm"]) @ params["head"]  # (b, s, vocab)
    labels = constrain(batch["labels"], ("batch", "seq"))
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def stages(cfg):
    return Stages(first=embed, block=lambda p, x, i: block(p, x, cfg), last=functools.partial(head_loss, cfg=cfg),
                  carry_names=lambda x: RESIDUAL)


def loss(params, batch, cfg):
    return stages(cfg).loss(params, batch)


def example_batch(cfg, batch_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (batch_size, cfg.seq_len + 1), generator=gen)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
