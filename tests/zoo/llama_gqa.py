"""A Llama-style decoder as a researcher writes it from scratch: RMSNorm, rotary tables built with
``torch.arange`` inside the loss, grouped-query attention (4 query heads, 2 kv heads), SwiGLU, an untied head
and plain ``F.cross_entropy``. Nothing of ``models/``; matmuls are ``@``."""

import dataclasses
import functools

import torch
import torch.nn.functional as F

import core
from shardings import attention, constrain
from shardings.pipeline import Stages

RESIDUAL = ("batch", "seq", "embed")
BLOCK_INPUT = ("batch", "block_seq", "embed")


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256  # token ids ("vocab"): bytes, what experiments.train feeds
    seq_len: int = 8  # tokens per example
    dim: int = 32  # residual width ("embed")
    heads: int = 4  # query heads ("heads")
    kv_heads: int = 2  # key/value heads ("kv_heads"): each serves heads // kv_heads query heads
    mlp: int = 64  # SwiGLU hidden width ("mlp")
    layers: int = 2  # decoder blocks
    theta: float = 10000.0  # RoPE base
    eps: float = 1e-6  # RMSNorm epsilon


def init(key, cfg):
    hd = cfg.dim // cfg.heads
    normal = lambda k, *shape: core.random.normal(k, shape) * shape[0] ** -0.5
    k_tok, k_head, k_blocks = core.random.split(key, 3)
    blocks = []
    for i in range(cfg.layers):
        kq, kk, kv, ko, kg, ku, kd = core.random.split(core.random.fold_in(k_blocks, i), 7)
        blocks.append({
            "attn_norm": torch.ones(cfg.dim),
            "wq": normal(kq, cfg.dim, cfg.heads, hd), "wk": normal(kk, cfg.dim, cfg.kv_heads, hd),
            "wv": normal(kv, cfg.dim, cfg.kv_heads, hd), "wo": normal(ko, cfg.heads, hd, cfg.dim) * hd**-0.5,
            "mlp_norm": torch.ones(cfg.dim),
            "w_gate": normal(kg, cfg.dim, cfg.mlp), "w_up": normal(ku, cfg.dim, cfg.mlp),
            "w_down": normal(kd, cfg.mlp, cfg.dim),
        })
    return {"tok": core.random.normal(k_tok, (cfg.vocab, cfg.dim)) * 0.02, "blocks": blocks,
            "norm": torch.ones(cfg.dim), "head": normal(k_head, cfg.dim, cfg.vocab)}


def axes(cfg):
    block = {"attn_norm": ("embed",), "wq": ("embed", "heads", "head_dim"), "wk": ("embed", "kv_heads", "head_dim"),
             "wv": ("embed", "kv_heads", "head_dim"), "wo": ("heads", "head_dim", "embed"), "mlp_norm": ("embed",),
             "w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed")}
    return {"tok": ("vocab", "embed"), "blocks": [dict(block) for _ in range(cfg.layers)], "norm": ("embed",),
            "head": ("embed", "vocab")}


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, theta, offset=0):
    """Rotate pairs of ``x: (b, s, h, d)`` by position (from ``offset``: a chunk after a prefix): the tables are made
    here, from ``torch.arange``."""
    s, d = x.shape[1], x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)  # (d/2,)
    angles = torch.outer(torch.arange(offset, offset + s, dtype=torch.float32), freqs)  # (s, d/2)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]  # (1, s, 1, d/2)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)  # (b, s, h, d), fp32
    return rotated.type_as(x)  # back to the compute dtype (Llama's apply_rotary_emb): v stays in it


def embed(params, batch):
    tokens = constrain(batch["tokens"], ("batch", "seq"))
    return constrain(F.embedding(tokens, params["tok"]), RESIDUAL)  # (b, s, dim)


def block(p, x, cfg):
    return prefix_block(p, x, [], cfg)[0]


def prefix_block(p, x, past, cfg):
    """The block on a chunk after ``past``, the earlier chunks' ``(k, v)`` (TeraPipe; ``[]``: a whole sequence):
    ``(x, (k, v))``."""
    offset = sum(pk.shape[1] for pk, _ in past)
    h = constrain(rms_norm(x, p["attn_norm"], cfg.eps), BLOCK_INPUT)
    q = rope(torch.einsum("bse,ehd->bshd", h, p["wq"]), cfg.theta, offset)  # (b, s, heads, hd)
    k = rope(torch.einsum("bse,ehd->bshd", h, p["wk"]), cfg.theta, offset)  # (b, s, kv_heads, hd)
    v = torch.einsum("bse,ehd->bshd", h, p["wv"])
    keys = torch.cat([pk for pk, _ in past] + [k], dim=1)  # (b, offset + s, kv_heads, hd)
    values = torch.cat([pv for _, pv in past] + [v], dim=1)
    a = attention(q, keys, values, causal=True)  # GQA; a prefix: query i sees keys 0..offset+i
    x = x + constrain(torch.einsum("bshd,hde->bse", a, p["wo"]), RESIDUAL)
    h = constrain(rms_norm(x, p["mlp_norm"], cfg.eps), BLOCK_INPUT)
    return x + constrain((F.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"], RESIDUAL), (k, v)


def head_loss(params, x, batch, cfg):
    logits = rms_norm(x, params["norm"], cfg.eps) @ params["head"]  # (b, s, vocab)
    labels = constrain(batch["labels"], ("batch", "seq"))
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def stages(cfg):
    return Stages(first=embed, block=lambda p, x, i: block(p, x, cfg), last=functools.partial(head_loss, cfg=cfg),
                  carry_names=lambda x: RESIDUAL, prefix_block=lambda p, x, i, past: prefix_block(p, x, past, cfg))


def loss(params, batch, cfg):
    return stages(cfg).loss(params, batch)


def example_batch(cfg, batch_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (batch_size, cfg.seq_len + 1), generator=gen)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}  # next-token prediction
