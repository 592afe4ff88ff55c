"""GPT-2 as a researcher writes it: learned positions, a bias on every projection (the key's included), tied
embeddings, GELU, attention written out with a causal mask from ``torch.ones(s, s).triu(1)``, a final LayerNorm.
Nothing of ``models/``."""

import dataclasses
import functools
import math

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
    seq_len: int = 8  # context length: one learned position each
    dim: int = 32  # residual width ("embed")
    heads: int = 4  # attention heads ("heads")
    layers: int = 2  # transformer blocks


def init(key, cfg):
    hd = cfg.dim // cfg.heads
    normal = lambda k, *shape: core.random.normal(k, shape) * 0.02  # GPT-2's init
    k_tok, k_pos, k_blocks = core.random.split(key, 3)
    blocks = []
    for i in range(cfg.layers):
        kq, kk, kv, ko, k1, k2 = core.random.split(core.random.fold_in(k_blocks, i), 6)
        blocks.append({
            "ln1_g": torch.ones(cfg.dim), "ln1_b": torch.zeros(cfg.dim),
            "q_w": normal(kq, cfg.dim, cfg.heads, hd), "q_b": torch.zeros(cfg.heads, hd),
            "k_w": normal(kk, cfg.dim, cfg.heads, hd), "k_b": torch.zeros(cfg.heads, hd),
            "v_w": normal(kv, cfg.dim, cfg.heads, hd), "v_b": torch.zeros(cfg.heads, hd),
            "proj_w": normal(ko, cfg.heads, hd, cfg.dim), "proj_b": torch.zeros(cfg.dim),
            "ln2_g": torch.ones(cfg.dim), "ln2_b": torch.zeros(cfg.dim),
            "fc_w": normal(k1, cfg.dim, 4 * cfg.dim), "fc_b": torch.zeros(4 * cfg.dim),
            "out_w": normal(k2, 4 * cfg.dim, cfg.dim), "out_b": torch.zeros(cfg.dim),
        })
    return {"wte": normal(k_tok, cfg.vocab, cfg.dim), "wpe": normal(k_pos, cfg.seq_len, cfg.dim), "blocks": blocks,
            "lnf_g": torch.ones(cfg.dim), "lnf_b": torch.zeros(cfg.dim)}


def axes(cfg):
    qkv, bias = ("embed", "heads", "head_dim"), ("heads", "head_dim")
    block = {"ln1_g": ("embed",), "ln1_b": ("embed",), "q_w": qkv, "q_b": bias, "k_w": qkv, "k_b": bias,
             "v_w": qkv, "v_b": bias, "proj_w": ("heads", "head_dim", "embed"), "proj_b": ("embed",),
             "ln2_g": ("embed",), "ln2_b": ("embed",), "fc_w": ("embed", "mlp"), "fc_b": ("mlp",),
             "out_w": ("mlp", "embed"), "out_b": ("embed",)}
    return {"wte": ("vocab", "embed"), "wpe": (None, "embed"), "blocks": [dict(block) for _ in range(cfg.layers)],
            "lnf_g": ("embed",), "lnf_b": ("embed",)}


def embed(params, batch, offset=0):
    """Tokens plus learned positions ``offset..offset+s-1``: a whole sequence from 0; a chunk of one cut by TeraPipe
    from its first token's place in the sequence (``Stages.prefix_first``: the executor passes it, so a chunk's
    batch needs nothing but its tokens and labels)."""
    tokens = constrain(batch["tokens"], ("batch", "seq"))
    pos = params["wpe"][offset: offset + tokens.shape[1]]  # (s, dim)
    return constrain(params["wte"][tokens] + pos, RESIDUAL)  # (b, s, dim)


def block(p, x, cfg):
    return prefix_block(p, x, [], cfg)[0]


def prefix_block(p, x, past, cfg):
    """The block on a chunk after ``past``, the earlier chunks' ``(k, v)`` (TeraPipe; ``[]``: a whole sequence):
    ``(x, (k, v))``."""
    s, offset = x.shape[1], sum(pk.shape[2] for pk, _ in past)
    h = constrain(F.layer_norm(x, (cfg.dim,), p["ln1_g"], p["ln1_b"]), BLOCK_INPUT)
    q = torch.einsum("bse,ehd->bhsd", h, p["q_w"]) + p["q_b"][:, None]  # (b, heads, s, hd)
    k = torch.einsum("bse,ehd->bhsd", h, p["k_w"]) + p["k_b"][:, None]
    v = torch.einsum("bse,ehd->bhsd", h, p["v_w"]) + p["v_b"][:, None]
    keys = torch.cat([pk for pk, _ in past] + [k], dim=2)  # (b, heads, offset + s, hd)
    values = torch.cat([pv for _, pv in past] + [v], dim=2)
    att = q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (b, heads, s, offset + s)
    mask = torch.ones(s, offset + s, dtype=torch.bool).triu(offset + 1)  # the future: query i sees 0..offset+i
    att = F.softmax(att.masked_fill(mask, float("-inf")), dim=-1)
    y = att @ values  # (b, heads, s, hd)
    x = x + constrain(torch.einsum("bhsd,hde->bse", y, p["proj_w"]), RESIDUAL) + p["proj_b"]
    h = constrain(F.layer_norm(x, (cfg.dim,), p["ln2_g"], p["ln2_b"]), BLOCK_INPUT)
    h = F.gelu(h @ p["fc_w"] + p["fc_b"], approximate="tanh")  # (b, s, 4 dim)
    return x + constrain(h @ p["out_w"], RESIDUAL) + p["out_b"], (k, v)


def head_loss(params, x, batch, cfg):
    x = F.layer_norm(x, (cfg.dim,), params["lnf_g"], params["lnf_b"])
    logits = x @ params["wte"].T  # tied: the token embedding is the head, (b, s, vocab)
    labels = constrain(batch["labels"], ("batch", "seq"))
    return F.cross_entropy(logits.reshape(-1, cfg.vocab).float(), labels.reshape(-1))


def stages(cfg):
    return Stages(first=embed, block=lambda p, x, i: block(p, x, cfg), last=functools.partial(head_loss, cfg=cfg),
                  carry_names=lambda x: RESIDUAL, prefix_block=lambda p, x, i, past: prefix_block(p, x, past, cfg),
                  prefix_first=embed)


def loss(params, batch, cfg):
    return stages(cfg).loss(params, batch)


def example_batch(cfg, batch_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (batch_size, cfg.seq_len + 1), generator=gen)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
