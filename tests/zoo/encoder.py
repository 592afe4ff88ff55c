"""A BERT-style encoder classifier written as a user would: docs/models.md shows this code as its worked example
(``tests/test_docs.py`` checks that the doc's block and this module's code below the docstring are identical)."""

import dataclasses
import functools

import torch
import torch.nn.functional as F

import core
from shardings import attention, constrain, einsum
from shardings.pipeline import Stages

RESIDUAL = ("batch", "seq", "embed")  # the residual stream between blocks (sp splits its seq over tp)
BLOCK_INPUT = ("batch", "block_seq", "embed")  # a normalized block input: whole seq for the matmuls


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 64  # token ids ("vocab"); id 0 is [CLS], the first token of every example
    seq_len: int = 8  # tokens per example ("seq"), one learned position each
    dim: int = 32  # residual width ("embed")
    heads: int = 4  # attention heads ("heads"), each dim // heads wide ("head_dim")
    mlp: int = 64  # GELU MLP width ("mlp")
    layers: int = 2  # encoder blocks (the list params["blocks"]: pp splits it)
    classes: int = 6  # labels of the [CLS] classifier (never split)
    eps: float = 1e-5  # LayerNorm epsilon


def init(key, cfg):
    head_dim = cfg.dim // cfg.heads
    normal = lambda k, *shape: core.random.normal(k, shape) * 0.02  # BERT's init: N(0, 0.02), biases 0
    k_tok, k_pos, k_cls, k_blocks = core.random.split(key, 4)
    blocks = []
    for i in range(cfg.layers):
        kq, kk, kv, ko, k1, k2 = core.random.split(core.random.fold_in(k_blocks, i), 6)
        blocks.append({
            "ln1_w": torch.ones(cfg.dim), "ln1_b": torch.zeros(cfg.dim),
            "wq": normal(kq, cfg.dim, cfg.heads, head_dim), "bq": torch.zeros(cfg.heads, head_dim),
            "wk": normal(kk, cfg.dim, cfg.heads, head_dim), "bk": torch.zeros(cfg.heads, head_dim),
            "wv": normal(kv, cfg.dim, cfg.heads, head_dim), "bv": torch.zeros(cfg.heads, head_dim),
            "wo": normal(ko, cfg.heads, head_dim, cfg.dim), "bo": torch.zeros(cfg.dim),
            "ln2_w": torch.ones(cfg.dim), "ln2_b": torch.zeros(cfg.dim),
            "w1": normal(k1, cfg.dim, cfg.mlp), "b1": torch.zeros(cfg.mlp),
            "w2": normal(k2, cfg.mlp, cfg.dim), "b2": torch.zeros(cfg.dim),
        })
    return {"tok": normal(k_tok, cfg.vocab, cfg.dim), "pos": normal(k_pos, cfg.seq_len, cfg.dim), "blocks": blocks,
            "ln_w": torch.ones(cfg.dim), "ln_b": torch.zeros(cfg.dim),
            "cls_w": normal(k_cls, cfg.dim, cfg.classes), "cls_b": torch.zeros(cfg.classes)}


def axes(cfg):
    qkv, bias = ("embed", "heads", "head_dim"), ("heads", "head_dim")
    block = {"ln1_w": ("embed",), "ln1_b": ("embed",), "wq": qkv, "bq": bias, "wk": qkv, "bk": bias,
             "wv": qkv, "bv": bias, "wo": ("heads", "head_dim", "embed"), "bo": ("embed",),
             "ln2_w": ("embed",), "ln2_b": ("embed",), "w1": ("embed", "mlp"), "b1": ("mlp",),
             "w2": ("mlp", "embed"), "b2": ("embed",)}
    return {"tok": ("vocab", "embed"), "pos": (None, "embed"), "blocks": [dict(block) for _ in range(cfg.layers)],
            "ln_w": ("embed",), "ln_b": ("embed",), "cls_w": ("embed", None), "cls_b": (None,)}


def layer_norm(x, w, b, cfg):
    return F.layer_norm(x, (cfg.dim,), w, b, cfg.eps)


def embed(params, batch, cfg):
    tokens = constrain(batch["tokens"], ("batch", "seq"))  # a plain batch becomes a sharded one
    return constrain(F.embedding(tokens, params["tok"]) + params["pos"], RESIDUAL)  # (batch, seq, dim)


def block(p, x, cfg):
    h = constrain(layer_norm(x, p["ln1_w"], p["ln1_b"], cfg), BLOCK_INPUT)  # pre-LayerNorm
    q, k, v = (einsum(h, p[f"w{n}"], "b s e, e h d -> b s h d") + p[f"b{n}"] for n in "qkv")  # (batch, seq, heads, d)
    a = attention(q, k, v, causal=False)  # every token sees every token
    x = x + constrain(einsum(a, p["wo"], "b s h d, h d e -> b s e"), RESIDUAL) + p["bo"]
    h = constrain(layer_norm(x, p["ln2_w"], p["ln2_b"], cfg), BLOCK_INPUT)
    hidden = constrain(F.gelu(einsum(h, p["w1"], "b s e, e f -> b s f") + p["b1"]), ("batch", "seq", "mlp"))
    return x + constrain(einsum(hidden, p["w2"], "b s f, f e -> b s e"), RESIDUAL) + p["b2"]


def head_loss(params, x, batch, cfg):
    x = constrain(layer_norm(x, params["ln_w"], params["ln_b"], cfg), BLOCK_INPUT)
    logits = einsum(x[:, 0], params["cls_w"], "b e, e c -> b c") + params["cls_b"]  # [CLS] pooling: (batch, classes)
    return F.cross_entropy(logits.float(), constrain(batch["labels"], ("batch",)))  # in fp32 under any policy


def stages(cfg):
    return Stages(first=functools.partial(embed, cfg=cfg),
                  block=lambda p, x, i: block(p, x, cfg),
                  last=functools.partial(head_loss, cfg=cfg),
                  carry_names=lambda x: RESIDUAL)


def loss(params, batch, cfg):
    return stages(cfg).loss(params, batch)


def example_batch(cfg, batch_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, cfg.vocab, (batch_size, cfg.seq_len), generator=gen)
    tokens[:, 0] = 0  # [CLS]
    return {"tokens": tokens, "labels": torch.randint(0, cfg.classes, (batch_size,), generator=gen)}
