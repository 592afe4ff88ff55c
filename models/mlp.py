"""The simplest reference model: a residual MLP on token embeddings, as pure functions.

embed → ``layers`` × [RMSNorm → up (dim → mlp) → gelu → down (mlp → dim) + residual] → RMSNorm →
unembed to vocab. Tokens do not see each other (no attention), so it learns next-token statistics
of the current token only; it exists to exercise layouts with the fewest moving parts. Same batch
and loss interface as :mod:`models.gpt`.

Parameter tree::

    {"embed": (vocab, dim),
     "blocks": [{"norm": (dim,), "w_up": (dim, mlp), "w_down": (mlp, dim)}, ...],
     "final_norm": (dim,),
     "unembed": (dim, vocab)}
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

import core
from models.layers import cross_entropy, next_token_batch, rms_norm
from shardings import constrain
from shardings.pipeline import Stages

__all__ = ["Config", "apply", "axes", "example_batch", "init", "loss", "stages"]

Params = dict[str, Any]
RESIDUAL = ("batch", "seq", "embed")
BLOCK_INPUT = ("batch", "block_seq", "embed")  # a normalized input to tensor-parallel matmuls


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyperparameters of the residual MLP. Defaults give a model that trains in a second on CPU.

    Raises:
        ValueError: a non-positive size.
    """

    vocab: int = 256  # vocabulary size; 256 = bytes, so synthetic data needs no tokenizer
    dim: int = 64  # residual stream width ("embed")
    mlp: int = 256  # hidden width of each block: 4·dim, the classic transformer ratio
    layers: int = 2  # number of residual blocks
    seq_len: int = 64  # sequence length of example_batch (positions are independent here)
    norm_eps: float = 1e-5  # RMSNorm epsilon (Llama 2 value)
    init_std: float = 0.02  # std of weight init (GPT-2); down projections get / sqrt(layers)
    ignore_index: int = -100  # label value excluded from the loss (PyTorch/HF convention)

    def __post_init__(self) -> None:
        for name in ("vocab", "dim", "mlp", "layers", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"mlp.Config: {name}={getattr(self, name)} must be >= 1. Fix: pass a positive {name}.")


def init(key: torch.Tensor, cfg: Config) -> Params:
    """Random parameters: normal(0, init_std) weights (down projections / sqrt(layers)), ones for norms.

    Each leaf is one ``core.random`` draw of its full shape times a scalar (block-evaluable).

    >>> tuple(init(core.random.key(0), Config())["blocks"][1]["w_up"].shape)
    (64, 256)
    """
    k_embed, k_unembed, k_blocks = core.random.split(key, 3)
    down_std = cfg.init_std / cfg.layers**0.5  # one residual branch per block (GPT-2 scaled init)
    blocks = []
    for i in range(cfg.layers):
        k_up, k_down = core.random.split(core.random.fold_in(k_blocks, i), 2)
        blocks.append(
            {
                "norm": torch.ones(cfg.dim),
                "w_up": core.random.normal(k_up, (cfg.dim, cfg.mlp)) * cfg.init_std,
                "w_down": core.random.normal(k_down, (cfg.mlp, cfg.dim)) * down_std,
            }
        )
    return {
        "embed": core.random.normal(k_embed, (cfg.vocab, cfg.dim)) * cfg.init_std,
        "blocks": blocks,
        "final_norm": torch.ones(cfg.dim),
        "unembed": core.random.normal(k_unembed, (cfg.dim, cfg.vocab)) * cfg.init_std,
    }


def axes(cfg: Config) -> Params:
    """Logical axis names of every parameter dim, in the same tree structure as :func:`init`.

    >>> axes(Config())["blocks"][0]["w_down"]
    ('mlp', 'embed')
    """
    block = {"norm": ("embed",), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed")}
    return {
        "embed": ("vocab", "embed"),
        "blocks": [dict(block) for _ in range(cfg.layers)],
        "final_norm": ("embed",),
        "unembed": ("embed", "vocab"),
    }


def apply(params: Params, tokens: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Logits ``(batch, seq, vocab)`` for int64 ``tokens: (batch, seq)``.

    >>> apply(init(core.random.key(0), Config()), torch.zeros(2, 3, dtype=torch.int64), Config()).shape
    torch.Size([2, 3, 256])
    """
    x = _embed(params, tokens)
    for p in params["blocks"]:
        x = _block(p, x, cfg)
    return _logits(params, x, cfg)


def _embed(params: Params, tokens: torch.Tensor) -> torch.Tensor:
    tokens = constrain(tokens, ("batch", "seq"))  # a plain batch becomes a DTensor under a mesh
    return constrain(F.embedding(tokens, params["embed"]), RESIDUAL)  # (batch, seq, dim)


def _block(p: Params, x: torch.Tensor, cfg: Config) -> torch.Tensor:
    h = constrain(rms_norm(x, p["norm"], cfg.norm_eps), BLOCK_INPUT)
    hidden = constrain(F.gelu(h @ p["w_up"]), ("batch", "seq", "mlp"))  # (batch, seq, mlp)
    return x + constrain(hidden @ p["w_down"], RESIDUAL)


def _logits(params: Params, x: torch.Tensor, cfg: Config) -> torch.Tensor:
    x = constrain(rms_norm(x, params["final_norm"], cfg.norm_eps), BLOCK_INPUT)
    return constrain(x @ params["unembed"], ("batch", "seq", "vocab"))


def loss(params: Params, batch: dict[str, torch.Tensor], cfg: Config) -> torch.Tensor:
    """Mean cross-entropy of ``batch["labels"]`` given ``batch["tokens"]`` (labels != ignore_index).

    >>> loss(init(core.random.key(0), Config()), example_batch(Config(), 2), Config()).shape
    torch.Size([])
    """
    return stages(cfg).loss(params, batch)


def stages(cfg: Config) -> Stages:
    """The pipeline declaration (``shardings.pipeline``); :func:`loss` is these composed."""
    return Stages(first=lambda params, batch: _embed(params, batch["tokens"]),
                  block=lambda p, x, i: _block(p, x, cfg),
                  last=lambda params, x, batch: cross_entropy(
                      _logits(params, x, cfg), constrain(batch["labels"], ("batch", "seq")), cfg.ignore_index),
                  carry_names=lambda x: RESIDUAL)


def example_batch(cfg: Config, batch_size: int, seed: int = 0, with_ignored: bool = False) -> dict[str, torch.Tensor]:
    """A deterministic synthetic next-token batch ``{"tokens", "labels"}`` of shape ``(batch_size, cfg.seq_len)``.

    >>> example_batch(Config(), 3, seed=1)["labels"].shape
    torch.Size([3, 64])
    """
    return next_token_batch(cfg.vocab, cfg.seq_len, batch_size, seed, cfg.ignore_index, with_ignored)
