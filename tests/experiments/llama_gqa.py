"""A Llama-style decoder as a researcher writes it, outside ``models/`` (the planner and CLIs take it by
``model.name=tests.experiments.llama_gqa``): RMSNorm, rotary tables built with ``torch.arange`` inside the loss,
grouped-query attention (4 query heads over 2 kv heads), SwiGLU, an untied head and plain ``F.cross_entropy``.
Its ``Config`` has no ``remat`` field and no ``head_dim`` (it is ``dim // heads``)."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import core
from shardings import constrain
from shardings.pipeline import Stages

RESIDUAL = ("batch", "seq", "embed")


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    dim: int = 32
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    mlp: int = 64
    seq_len: int = 16
    theta: float = 10000.0


def init(key, cfg):
    hd = cfg.dim // cfg.heads
    keys = core.random.split(key, 2 + cfg.layers)

    def block(k):
        kq, kk, kv, ko, kg, ku, kd = core.random.split(k, 7)
        return {"attn_norm": torch.ones(cfg.dim), "mlp_norm": torch.ones(cfg.dim),
                "wq": core.random.normal(kq, (cfg.dim, cfg.heads, hd)) * 0.02,
                "wk": core.random.normal(kk, (cfg.dim, cfg.kv_heads, hd)) * 0.02,
                "wv": core.random.normal(kv, (cfg.dim, cfg.kv_heads, hd)) * 0.02,
                "wo": core.random.normal(ko, (cfg.heads, hd, cfg.dim)) * 0.02,
                "w_gate": core.random.normal(kg, (cfg.dim, cfg.mlp)) * 0.02,
                "w_up": core.random.normal(ku, (cfg.dim, cfg.mlp)) * 0.02,
                "w_down": core.random.normal(kd, (cfg.mlp, cfg.dim)) * 0.02}

    return {"embed": core.random.normal(keys[0], (cfg.vocab, cfg.dim)) * 0.02,
            "blocks": [block(k) for k in keys[2:]],
            "norm": torch.ones(cfg.dim),
            "head": core.random.normal(keys[1], (cfg.dim, cfg.vocab)) * 0.02}


def axes(cfg):
    block = {"attn_norm": ("embed",), "mlp_norm": ("embed",),
             "wq": ("embed", "heads", "head_dim"), "wk": ("embed", "kv_heads", "head_dim"),
             "wv": ("embed", "kv_heads", "head_dim"), "wo": ("heads", "head_dim", "embed"),
             "w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed")}
    return {"embed": ("vocab", "embed"), "blocks": [dict(block) for _ in range(cfg.layers)], "norm": ("embed",),
            "head": ("embed", "vocab")}


def rms_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, theta):
    s, hd = x.shape[1], x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    angles = torch.outer(torch.arange(s).float(), freqs)  # (seq, hd/2)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


def block(p, x, cfg):
    h = rms_norm(x, p["attn_norm"])
    q = rope(torch.einsum("bse,ehd->bshd", h, p["wq"]), cfg.theta)
    k = rope(torch.einsum("bse,ehd->bshd", h, p["wk"]), cfg.theta)
    v = torch.einsum("bse,ehd->bshd", h, p["wv"])
    rep = q.shape[2] // k.shape[2]  # query heads per kv head (local under tp)
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    x = x + constrain(torch.einsum("bhsd,hde->bse", o, p["wo"]), RESIDUAL)
    h = rms_norm(x, p["mlp_norm"])
    return constrain(x + (F.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"], RESIDUAL)


def embed(params, batch):
    return constrain(F.embedding(constrain(batch["tokens"], ("batch", "seq")), params["embed"]), RESIDUAL)


def head_loss(params, x, batch):
    logits = rms_norm(x, params["norm"]) @ params["head"]
    labels = constrain(batch["labels"], ("batch", "seq"))
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def loss(params, batch, cfg):
    x = embed(params, batch)
    for p in params["blocks"]:
        x = block(p, x, cfg)
    return head_loss(params, x, batch)


def stages(cfg):
    return Stages(first=embed, block=lambda p, x, i: block(p, x, cfg), last=head_loss,
                  carry_names=lambda x: RESIDUAL)


def example_batch(cfg, batch_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (batch_size, cfg.seq_len + 1), generator=g)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
