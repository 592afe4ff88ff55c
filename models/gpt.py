"""A Llama-style decoder as pure functions over a parameter pytree.

Token embedding → ``layers`` × [RMSNorm → causal attention (RoPE, MHA/GQA/MQA) + residual →
RMSNorm → SwiGLU + residual] → RMSNorm → unembedding (optionally tied to the embedding).

Parameter tree (``axes(cfg)`` gives the logical name of every dim)::

    {"embed": (vocab, dim),
     "blocks": [{"attn_norm": (dim,),
                 "wq": (dim, heads, head_dim), "wk": (dim, kv_heads, head_dim), "wv": (dim, kv_heads, head_dim),
                 "wo": (heads, head_dim, dim),
                 "mlp_norm": (dim,),
                 "w_gate": (dim, mlp), "w_up": (dim, mlp), "w_down": (mlp, dim)}, ...],
     "final_norm": (dim,),
     "unembed": (dim, vocab)}            # absent when cfg.tie_embeddings

Attention weights are 3-D so each dim has exactly one logical name: ``heads`` can be sharded
over a tensor-parallel axis while ``head_dim`` stays whole. Checkpoints convert to and from
Hugging Face ``LlamaForCausalLM`` with :func:`from_hf_llama` / :func:`to_hf_llama`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

import core
from models.hf_llama import config_from_hf, from_hf_llama, hf_config, to_hf_llama
from models.layers import attention, cross_entropy, einsum, embedding, next_token_batch, rms_norm, rope, swiglu
from shardings import constrain
from shardings.pipeline import Stages

__all__ = [
    "Config",
    "apply",
    "axes",
    "config_from_hf",
    "embed",
    "example_batch",
    "from_hf_llama",
    "hf_config",
    "init",
    "logits",
    "loss",
    "stages",
    "to_hf_llama",
]

Params = dict[str, Any]
RESIDUAL = ("batch", "seq", "embed")
BLOCK_INPUT = ("batch", "block_seq", "embed")  # a normalized input to tensor-parallel matmuls (SP gathers it)
BATCH_INPUT = ("batch", "block_seq")  # tokens and labels: seq as the vocab-parallel embedding and loss see it


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyperparameters of the decoder. Defaults give a tiny model that trains in seconds on CPU.

    ``kv_heads`` and ``head_dim`` default to ``None`` (meaning ``heads`` and ``dim // heads``) rather
    than to numbers, so ``dataclasses.replace(cfg, heads=8)`` keeps meaning "MHA, derived head_dim";
    read the resolved values from :attr:`n_kv_heads` and :attr:`d_head`.

    Raises:
        ValueError: a non-positive size, ``kv_heads`` not dividing ``heads``, ``dim`` not divisible
            by ``heads`` when ``head_dim`` is derived, or an odd head dim (RoPE rotates pairs).
    """

    vocab: int = 256  # vocabulary size; 256 = bytes, so synthetic data needs no tokenizer
    dim: int = 128  # residual stream width ("embed")
    layers: int = 2  # number of decoder blocks
    heads: int = 4  # query heads
    kv_heads: int | None = None  # key/value heads (GQA: divides heads, 1 = MQA); None -> heads (MHA)
    head_dim: int | None = None  # width of one head; None -> dim // heads (the Llama convention)
    mlp: int = 384  # SwiGLU hidden width: ~8/3·dim rounded up to a multiple of 128, as in Llama
    seq_len: int = 64  # sequence length of example_batch (RoPE itself works at any length)
    rope_theta: float = 10000.0  # RoPE base frequency (Llama 1/2 value; HF LlamaConfig default)
    norm_eps: float = 1e-5  # RMSNorm epsilon (Llama 2 value)
    tie_embeddings: bool = False  # reuse the embedding as the unembedding (no "unembed" param)
    remat: bool | str = False  # per block (core.remat): True recomputes in backward; "offload": saved on host
    init_std: float = 0.02  # std of weight init (GPT-2/Llama); output projections get / sqrt(2·layers)
    ignore_index: int = -100  # label value excluded from the loss (PyTorch/HF convention)

    def __post_init__(self) -> None:
        if self.remat not in (True, False, "offload"):
            raise ValueError(f"gpt.Config.remat must be True, False or 'offload', got {self.remat!r}")
        sizes = {"vocab": self.vocab, "dim": self.dim, "layers": self.layers, "heads": self.heads, "mlp": self.mlp}
        sizes |= {"seq_len": self.seq_len, "kv_heads": self.n_kv_heads}
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"gpt.Config: {name}={value} must be >= 1. Fix: pass a positive {name}.")
        if self.heads % self.n_kv_heads:
            raise ValueError(
                f"gpt.Config: kv_heads={self.kv_heads} must divide heads={self.heads} (each group of "
                f"heads // kv_heads query heads shares one key/value head). Fix: pick kv_heads among "
                f"{[d for d in range(1, self.heads + 1) if self.heads % d == 0]}."
            )
        if self.head_dim is None and self.dim % self.heads:
            raise ValueError(
                f"gpt.Config: dim={self.dim} is not divisible by heads={self.heads}, so head_dim cannot be "
                f"derived. Fix: change dim or heads, or pass head_dim explicitly."
            )
        if self.d_head < 2 or self.d_head % 2:
            raise ValueError(
                f"gpt.Config: head_dim={self.d_head} must be even and >= 2 (RoPE rotates pairs of dims). "
                f"Fix: pick an even head_dim (or dim // heads)."
            )

    @property
    def n_kv_heads(self) -> int:
        """The number of key/value heads (``kv_heads``, or ``heads`` when unset)."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def d_head(self) -> int:
        """The width of one attention head (``head_dim``, or ``dim // heads`` when unset)."""
        return self.dim // self.heads if self.head_dim is None else self.head_dim


def init(key: torch.Tensor, cfg: Config) -> Params:
    """Random parameters: normal(0, init_std) weights, ones for norms.

    Output projections (``wo``, ``w_down``) use ``init_std / sqrt(2 · layers)`` (GPT-2's scaled
    init: each block adds two residual branches, so the residual variance stays ~constant in depth).
    Each leaf is one ``core.random`` draw of its full shape times a scalar, so a sharded init can
    evaluate any block of it alone; keys are split per leaf and folded per layer.

    Args:
        key: a ``core.random.key``.
        cfg: the model config.

    Returns:
        The parameter tree described in the module docstring.

    >>> params = init(core.random.key(0), Config(layers=1))
    >>> tuple(params["blocks"][0]["wq"].shape)
    (128, 4, 32)
    """
    k_embed, k_unembed, k_blocks = core.random.split(key, 3)
    params = {
        "embed": core.random.normal(k_embed, (cfg.vocab, cfg.dim)) * cfg.init_std,
        "blocks": [_init_block(core.random.fold_in(k_blocks, i), cfg) for i in range(cfg.layers)],
        "final_norm": torch.ones(cfg.dim),
    }
    if not cfg.tie_embeddings:
        params["unembed"] = core.random.normal(k_unembed, (cfg.dim, cfg.vocab)) * cfg.init_std
    return params


def _init_block(key: torch.Tensor, cfg: Config) -> Params:
    kq, kk, kv, ko, kg, ku, kd = core.random.split(key, 7)
    std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.layers) ** 0.5
    q_shape, kv_shape = (cfg.dim, cfg.heads, cfg.d_head), (cfg.dim, cfg.n_kv_heads, cfg.d_head)
    return {
        "attn_norm": torch.ones(cfg.dim),
        "wq": core.random.normal(kq, q_shape) * std,
        "wk": core.random.normal(kk, kv_shape) * std,
        "wv": core.random.normal(kv, kv_shape) * std,
        "wo": core.random.normal(ko, (cfg.heads, cfg.d_head, cfg.dim)) * out_std,
        "mlp_norm": torch.ones(cfg.dim),
        "w_gate": core.random.normal(kg, (cfg.dim, cfg.mlp)) * std,
        "w_up": core.random.normal(ku, (cfg.dim, cfg.mlp)) * std,
        "w_down": core.random.normal(kd, (cfg.mlp, cfg.dim)) * out_std,
    }


def axes(cfg: Config) -> Params:
    """Logical axis names of every parameter dim, in the same tree structure as :func:`init`.

    >>> axes(Config(layers=1))["blocks"][0]["wk"]
    ('embed', 'kv_heads', 'head_dim')
    """
    block = {
        "attn_norm": ("embed",),
        "wq": ("embed", "heads", "head_dim"),
        "wk": ("embed", "kv_heads", "head_dim"),
        "wv": ("embed", "kv_heads", "head_dim"),
        "wo": ("heads", "head_dim", "embed"),
        "mlp_norm": ("embed",),
        "w_gate": ("embed", "mlp"),
        "w_up": ("embed", "mlp"),
        "w_down": ("mlp", "embed"),
    }
    tree = {"embed": ("vocab", "embed"), "blocks": [dict(block) for _ in range(cfg.layers)], "final_norm": ("embed",)}
    if not cfg.tie_embeddings:
        tree["unembed"] = ("embed", "vocab")
    return tree


def _block(p: Params, x: torch.Tensor, cfg: Config) -> torch.Tensor:
    """One decoder block on the residual stream ``x: (batch, seq, dim)``."""
    x = _attention_residual(p, x, cfg)
    h = constrain(rms_norm(x, p["mlp_norm"], cfg.norm_eps), BLOCK_INPUT)
    return x + constrain(swiglu(h, p["w_gate"], p["w_up"], p["w_down"]), RESIDUAL)


def _attention_residual(p: Params, x: torch.Tensor, cfg: Config) -> torch.Tensor:
    """``x + attention(rms_norm(x))``: the first half of a block (models.moe reuses it)."""
    return _attention_over(p, x, cfg, ())[0]


def _attention_over(p: Params, x: torch.Tensor, cfg: Config, past: Any) -> tuple[torch.Tensor, Any]:
    """``x + attention(rms_norm(x))`` for a chunk of the sequence after ``past``, the ``(k, v)`` of the earlier
    chunks (TeraPipe; ``()`` for a whole sequence): RoPE from the chunk's position, its queries attend over the
    prefix's keys and their own causally (the fused kernel with a mask). Returns the chunk's ``(k, v)`` too."""
    offset = sum(pk.shape[1] for pk, _ in past)
    h = constrain(rms_norm(x, p["attn_norm"], cfg.norm_eps), BLOCK_INPUT)
    q = einsum(h, p["wq"], "b s e, e h d -> b s h d")  # (batch, seq, heads, head_dim)
    k = einsum(h, p["wk"], "b s e, e k d -> b s k d")  # (batch, seq, kv_heads, head_dim)
    v = einsum(h, p["wv"], "b s e, e k d -> b s k d")
    q = constrain(rope(q, cfg.rope_theta, offset), ("batch", "seq", "heads", "head_dim"))
    k = constrain(rope(k, cfg.rope_theta, offset), ("batch", "seq", "kv_heads", "head_dim"))
    v = constrain(v, ("batch", "seq", "kv_heads", "head_dim"))
    keys = torch.cat([pk for pk, _ in past] + [k], dim=1) if past else k
    values = torch.cat([pv for _, pv in past] + [v], dim=1) if past else v
    out = attention(q, keys, values)  # (batch, seq, heads, head_dim)
    return x + constrain(einsum(out, p["wo"], "b s h d, h d e -> b s e"), RESIDUAL), (k, v)


def _prefix_block(p: Params, x: torch.Tensor, past: Any, cfg: Config) -> tuple[torch.Tensor, Any]:
    """One decoder block on a chunk of the sequence after ``past`` (:func:`_attention_over`): ``(x, (k, v))``."""
    x, present = _attention_over(p, x, cfg, past)
    h = constrain(rms_norm(x, p["mlp_norm"], cfg.norm_eps), BLOCK_INPUT)
    return x + constrain(swiglu(h, p["w_gate"], p["w_up"], p["w_down"]), RESIDUAL), present


def apply(params: Params, tokens: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Next-token logits ``(batch, seq, vocab)`` for int64 ``tokens: (batch, seq)``.

    >>> cfg = Config(layers=1)
    >>> apply(init(core.random.key(0), cfg), torch.zeros(2, 5, dtype=torch.int64), cfg).shape
    torch.Size([2, 5, 256])
    """
    x = embed(params, tokens)
    block = functools.partial(_block, cfg=cfg)
    if cfg.remat:
        block = core.remat(block, policy="offload" if cfg.remat == "offload" else None)
    for p in params["blocks"]:
        x = block(p, x)
    return logits(params, x, cfg)


def embed(params: Params, tokens: torch.Tensor) -> torch.Tensor:
    """The residual stream ``(batch, seq, dim)`` of int64 ``tokens: (batch, seq)``.

    The tokens enter like a block input (sp gathers their seq): with vocab-sharded rows each rank
    looks up its own and the partial sums are reduce-scattered into the residual stream, as
    torchtitan's ``RowwiseParallel`` embedding. A plain batch becomes a DTensor under a mesh.
    """
    return constrain(embedding(constrain(tokens, BATCH_INPUT), params["embed"]), RESIDUAL)


def logits(params: Params, x: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Next-token logits ``(batch, seq, vocab)`` of the residual stream: final norm, then the unembedding."""
    x = constrain(rms_norm(x, params["final_norm"], cfg.norm_eps), BLOCK_INPUT)
    unembed = params["embed"].T if cfg.tie_embeddings else params["unembed"]  # (dim, vocab)
    return constrain(einsum(x, unembed, "b s e, e v -> b s v"), ("batch", "block_seq", "vocab"))


def loss(params: Params, batch: dict[str, torch.Tensor], cfg: Config) -> torch.Tensor:
    """Mean causal-LM cross-entropy of ``batch["labels"]`` (already shifted) given ``batch["tokens"]``.

    >>> cfg = Config(layers=1)
    >>> loss(init(core.random.key(0), cfg), example_batch(cfg, 2), cfg).shape
    torch.Size([])
    """
    return stages(cfg).loss(params, batch)


def stages(cfg: Config) -> Stages:
    """The pipeline declaration (``shardings.pipeline``): embedding, decoder blocks, head and loss.

    :func:`loss` is these composed, so a pipelined run's reference is this model's own loss. ``prefix_block``
    runs a block on a chunk of the sequence after the earlier chunks' keys and values (TeraPipe,
    ``pipeline.plan(..., seq_chunks=k)``).

    >>> cfg = Config(layers=1)
    >>> params, batch = init(core.random.key(0), cfg), example_batch(cfg, 2)
    >>> bool(stages(cfg).loss(params, batch) == loss(params, batch, cfg))
    True
    """
    block, prefix_block = functools.partial(_block, cfg=cfg), functools.partial(_prefix_block, cfg=cfg)
    if cfg.remat:
        policy = "offload" if cfg.remat == "offload" else None
        block, prefix_block = core.remat(block, policy=policy), core.remat(prefix_block, policy=policy)
    return Stages(first=lambda params, batch: embed(params, batch["tokens"]),
                  block=lambda p, x, i: block(p, x),
                  last=functools.partial(_head_loss, cfg=cfg), carry_names=lambda x: RESIDUAL,
                  prefix_block=lambda p, x, i, past: prefix_block(p, x, past))


def _head_loss(params: Params, x: torch.Tensor, batch: dict[str, torch.Tensor], cfg: Config) -> torch.Tensor:
    labels = constrain(batch["labels"], BATCH_INPUT)  # laid out like the logits' (batch, seq)
    return cross_entropy(logits(params, x, cfg), labels, cfg.ignore_index)


def example_batch(cfg: Config, batch_size: int, seed: int = 0, with_ignored: bool = False) -> dict[str, torch.Tensor]:
    """A deterministic synthetic batch ``{"tokens", "labels"}`` of shape ``(batch_size, cfg.seq_len)``.

    ``cfg.seq_len + 1`` random tokens per row are split into inputs and next-token labels; with
    ``with_ignored`` a few labels are ``cfg.ignore_index``.

    >>> example_batch(Config(), 2)["tokens"].shape
    torch.Size([2, 64])
    """
    return next_token_batch(cfg.vocab, cfg.seq_len, batch_size, seed, cfg.ignore_index, with_ignored)
