"""A Vision Transformer as a researcher writes it: patches cut with ``einops.rearrange``, a linear patch
embedding, a learned class token prepended, learned positions, pre-LayerNorm blocks with
``F.scaled_dot_product_attention`` (no causal mask: every patch sees every patch), the class token's final state
classified. Nothing of ``models/``."""

import dataclasses
import functools

import torch
import torch.nn.functional as F
from einops import rearrange

import core
from shardings import constrain
from shardings.pipeline import Stages

RESIDUAL = ("batch", "seq", "embed")
BLOCK_INPUT = ("batch", "block_seq", "embed")


@dataclasses.dataclass(frozen=True)
class Config:
    image: int = 12  # height and width in pixels
    patch: int = 4  # patch side: (image / patch)² = 9 patches, + the class token = 10 tokens
    channels: int = 3
    dim: int = 32  # residual width ("embed")
    heads: int = 4  # attention heads ("heads")
    mlp: int = 64  # GELU MLP width ("mlp")
    layers: int = 2
    classes: int = 10  # never split

    @property
    def tokens(self) -> int:
        return (self.image // self.patch) ** 2 + 1


def init(key, cfg):
    hd, pdim = cfg.dim // cfg.heads, cfg.patch * cfg.patch * cfg.channels
    normal = lambda k, *shape: core.random.normal(k, shape) * 0.02
    k_patch, k_cls, k_pos, k_head, k_blocks = core.random.split(key, 5)
    blocks = []
    for i in range(cfg.layers):
        kq, kk, kv, ko, k1, k2 = core.random.split(core.random.fold_in(k_blocks, i), 6)
        blocks.append({
            "ln1_w": torch.ones(cfg.dim), "ln1_b": torch.zeros(cfg.dim),
            "wq": normal(kq, cfg.dim, cfg.heads, hd), "wk": normal(kk, cfg.dim, cfg.heads, hd),
            "wv": normal(kv, cfg.dim, cfg.heads, hd), "wo": normal(ko, cfg.heads, hd, cfg.dim),
            "ln2_w": torch.ones(cfg.dim), "ln2_b": torch.zeros(cfg.dim),
            "w1": normal(k1, cfg.dim, cfg.mlp), "b1": torch.zeros(cfg.mlp),
            "w2": normal(k2, cfg.mlp, cfg.dim), "b2": torch.zeros(cfg.dim),
        })
    return {"patch_w": normal(k_patch, pdim, cfg.dim), "patch_b": torch.zeros(cfg.dim),
            "cls": normal(k_cls, cfg.dim), "pos": normal(k_pos, cfg.tokens, cfg.dim), "blocks": blocks,
            "ln_w": torch.ones(cfg.dim), "ln_b": torch.zeros(cfg.dim),
            "head_w": normal(k_head, cfg.dim, cfg.classes), "head_b": torch.zeros(cfg.classes)}


def axes(cfg):
    qkv = ("embed", "heads", "head_dim")
    block = {"ln1_w": ("embed",), "ln1_b": ("embed",), "wq": qkv, "wk": qkv, "wv": qkv,
             "wo": ("heads", "head_dim", "embed"), "ln2_w": ("embed",), "ln2_b": ("embed",),
             "w1": ("embed", "mlp"), "b1": ("mlp",), "w2": ("mlp", "embed"), "b2": ("embed",)}
    return {"patch_w": (None, "embed"), "patch_b": ("embed",), "cls": ("embed",), "pos": (None, "embed"),
            "blocks": [dict(block) for _ in range(cfg.layers)], "ln_w": ("embed",), "ln_b": ("embed",),
            "head_w": ("embed", None), "head_b": (None,)}


def embed(params, batch, cfg):
    images = constrain(batch["images"], ("batch", None, None, None))  # (b, c, h, w)
    patches = rearrange(images, "b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=cfg.patch, p2=cfg.patch)
    x = patches.to(params["patch_w"].dtype) @ params["patch_w"] + params["patch_b"]  # pixels in the compute dtype
    cls = params["cls"].expand(x.shape[0], 1, cfg.dim)  # (b, 1, dim)
    return constrain(torch.cat([cls, x], dim=1) + params["pos"], RESIDUAL)  # (b, tokens, dim)


def block(p, x, cfg):
    h = constrain(F.layer_norm(x, (cfg.dim,), p["ln1_w"], p["ln1_b"]), BLOCK_INPUT)
    q, k, v = (torch.einsum("bse,ehd->bhsd", h, p[w]) for w in ("wq", "wk", "wv"))  # (b, heads, tokens, hd)
    a = F.scaled_dot_product_attention(q, k, v)  # no mask
    x = x + constrain(torch.einsum("bhsd,hde->bse", a, p["wo"]), RESIDUAL)
    h = constrain(F.layer_norm(x, (cfg.dim,), p["ln2_w"], p["ln2_b"]), BLOCK_INPUT)
    return x + constrain(F.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"], RESIDUAL)


def head_loss(params, x, batch, cfg):
    x = F.layer_norm(x, (cfg.dim,), params["ln_w"], params["ln_b"])
    logits = x[:, 0] @ params["head_w"] + params["head_b"]  # the class token: (b, classes)
    return F.cross_entropy(logits.float(), constrain(batch["labels"], ("batch",)))


def stages(cfg):
    return Stages(first=functools.partial(embed, cfg=cfg), block=lambda p, x, i: block(p, x, cfg),
                  last=functools.partial(head_loss, cfg=cfg), carry_names=lambda x: RESIDUAL)


def loss(params, batch, cfg):
    return stages(cfg).loss(params, batch)


def example_batch(cfg, batch_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {"images": torch.randn(batch_size, cfg.channels, cfg.image, cfg.image, generator=gen),
            "labels": torch.randint(0, cfg.classes, (batch_size,), generator=gen)}
