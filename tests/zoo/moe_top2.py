"""A top-2 mixture-of-experts decoder as a researcher writes it, with its own router and load-balancing loss (not
``models.moe``): each block is causal attention then a MoE MLP whose router picks 2 of ``experts`` per token
(softmax, ``topk``, gates renormalized), every expert computed densely and mixed by the gates (no capacity, no
dropped tokens), and Switch's auxiliary loss ``E · Σ_e f_e · p_e`` per sequence, carried between blocks.
Nothing of ``models/``."""

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
    seq_len: int = 8
    dim: int = 32  # residual width ("embed")
    heads: int = 4  # attention heads ("heads")
    experts: int = 4  # experts per block ("expert": ep splits them)
    top_k: int = 2  # experts per token
    mlp: int = 32  # each expert's hidden width ("mlp")
    layers: int = 2
    aux_coef: float = 0.01  # load-balancing loss weight


def init(key, cfg):
    hd = cfg.dim // cfg.heads
    normal = lambda k, *shape: core.random.normal(k, shape) * 0.02
    k_tok, k_pos, k_head, k_blocks = core.random.split(key, 4)
    blocks = []
    for i in range(cfg.layers):
        kq, kk, kv, ko, kr, k1, k2 = core.random.split(core.random.fold_in(k_blocks, i), 7)
        blocks.append({
            "ln1": torch.ones(cfg.dim), "wq": normal(kq, cfg.dim, cfg.heads, hd),
            "wk": normal(kk, cfg.dim, cfg.heads, hd), "wv": normal(kv, cfg.dim, cfg.heads, hd),
            "wo": normal(ko, cfg.heads, hd, cfg.dim), "ln2": torch.ones(cfg.dim),
            "router": normal(kr, cfg.dim, cfg.experts),
            "w_in": normal(k1, cfg.experts, cfg.dim, cfg.mlp), "w_out": normal(k2, cfg.experts, cfg.mlp, cfg.dim),
        })
    return {"tok": normal(k_tok, cfg.vocab, cfg.dim), "pos": normal(k_pos, cfg.seq_len, cfg.dim), "blocks": blocks,
            "ln_f": torch.ones(cfg.dim), "head": normal(k_head, cfg.dim, cfg.vocab)}


def axes(cfg):
    qkv = ("embed", "heads", "head_dim")
    block = {"ln1": ("embed",), "wq": qkv, "wk": qkv, "wv": qkv, "wo": ("heads", "head_dim", "embed"),
             "ln2": ("embed",), "router": ("embed", None),
             "w_in": ("expert", "embed", "mlp"), "w_out": ("expert", "mlp", "embed")}
    return {"tok": ("vocab", "embed"), "pos": (None, "embed"), "blocks": [dict(block) for _ in range(cfg.layers)],
            "ln_f": ("embed",), "head": ("embed", "vocab")}


def rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def moe(p, h, cfg):
    """The MoE MLP of ``h: (b, s, dim)``: output and each sequence's load-balancing loss ``(b,)``."""
    probs = F.softmax(h @ p["router"], dim=-1)  # (b, s, experts)
    top_p, top_i = probs.topk(cfg.top_k, dim=-1)  # (b, s, k)
    gates = torch.zeros_like(probs).scatter(-1, top_i, top_p / top_p.sum(-1, keepdim=True))  # (b, s, experts)
    hidden = F.gelu(torch.einsum("bsd,xdf->bsxf", h, p["w_in"]))  # every expert on every token: (b, s, x, mlp)
    y = torch.einsum("bsxf,xfd,bsx->bsd", hidden, p["w_out"], gates)
    chosen = F.one_hot(top_i, cfg.experts).sum(2).float()  # (b, s, experts): 1 where routed
    aux = cfg.experts * (chosen.mean(1) / cfg.top_k * probs.mean(1)).sum(-1)  # Switch's loss per sequence, (b,)
    return y, aux


def embed(params, batch):
    tokens = constrain(batch["tokens"], ("batch", "seq"))
    x = constrain(F.embedding(tokens, params["tok"]) + params["pos"][: tokens.shape[1]], RESIDUAL)
    return x, torch.zeros(tokens.shape[0])  # the residual stream and the aux loss so far, (b,)


def block(p, carry, cfg):
    x, aux = carry
    h = constrain(rms_norm(x, p["ln1"]), BLOCK_INPUT)
    q, k, v = (torch.einsum("bse,ehd->bshd", h, p[w]) for w in ("wq", "wk", "wv"))  # (b, s, heads, hd)
    x = x + constrain(torch.einsum("bshd,hde->bse", attention(q, k, v, causal=True), p["wo"]), RESIDUAL)
    y, block_aux = moe(p, constrain(rms_norm(x, p["ln2"]), BLOCK_INPUT), cfg)
    return x + constrain(y, RESIDUAL), aux + block_aux


def head_loss(params, carry, batch, cfg):
    x, aux = carry
    logits = rms_norm(x, params["ln_f"]) @ params["head"]  # (b, s, vocab)
    labels = constrain(batch["labels"], ("batch", "seq"))
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()) + cfg.aux_coef * aux.mean()


def stages(cfg):
    return Stages(first=embed, block=lambda p, c, i: block(p, c, cfg), last=functools.partial(head_loss, cfg=cfg),
                  carry_names=lambda c: (RESIDUAL, ("batch",)))


def loss(params, batch, cfg):
    return stages(cfg).loss(params, batch)


def example_batch(cfg, batch_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (batch_size, cfg.seq_len + 1), generator=gen)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
