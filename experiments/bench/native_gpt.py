"""``models.gpt`` written as a PyTorch user would write it, and its torchtitan-style tensor-parallel plan.

The benchmarks' reference side (``experiments/bench/wrappers.py``, ``experiments/bench/jit.py``): ``nn.Embedding``,
``nn.Linear`` q/k/v/o and gate/up/down (no bias), ``nn.RMSNorm``, RoPE in the module (HF Llama's
``rotate_half``, ``cfg.rope_theta``), ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``
and ``F.cross_entropy`` — none of shardlab's compute (``models.layers``) — built from a gpt parameter
tree (:func:`from_params`) and mapped back to one (:func:`to_params`). Its ``forward(batch)``
computes ``gpt.loss``'s value; tests/experiments/bench/test_native_gpt.py checks loss and gradients by
``shardings.testing``'s tolerance rule.

Numerics against ``models.layers``: ``nn.RMSNorm`` (torch's ``rms_norm``) normalizes in float32 like
HF's ``LlamaRMSNorm`` but multiplies by the weight *before* casting back to the input dtype, where HF
(and ``models.layers.rms_norm``) cast first and multiply after (so a bfloat16 input with a float32
weight gives a bfloat16 output here, a float32 one there). The norms here only see the float32
residual stream (bf16 autocast leaves it float32), where the two are the same ops on CPU (bitwise
equal); CUDA may pick torch's fused kernel, another summation order. SDPA's kernels and the
einsum-softmax reference differ by rounding; the RoPE tables are computed by the same float32 formula.

Under :func:`parallelize` (``parallelize_module`` with :func:`tp_plan`) the residual stream is
sequence-parallel, q/k/v/gate/up are column-parallel, o/down row-parallel, and the logits stay
vocab-sharded for ``loss_parallel`` — torchtitan's Llama plan. The projections return local tensors
(``use_local_output=True``), so SDPA runs on plain tensors and attention reads its head count from
their local width: each rank runs ``heads / tp`` query heads, as torchtitan does.
"""

from __future__ import annotations

from typing import Any

import einops
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import models.gpt as gpt
from shardings import sharding_error

__all__ = ["NativeGpt", "compile_blocks", "from_params", "parallelize", "to_params", "tp_plan"]

# tree key -> (parameter name in a Block, einops pattern from the tree layout to the module's layout)
_BLOCK = {
    "attn_norm": ("attn_norm.weight", "e -> e"),
    "wq": ("attn.wq.weight", "e h d -> (h d) e"),  # nn.Linear weight is (out, in)
    "wk": ("attn.wk.weight", "e k d -> (k d) e"),
    "wv": ("attn.wv.weight", "e k d -> (k d) e"),
    "wo": ("attn.wo.weight", "h d e -> e (h d)"),
    "mlp_norm": ("mlp_norm.weight", "e -> e"),
    "w_gate": ("mlp.gate.weight", "e f -> f e"),
    "w_up": ("mlp.up.weight", "e f -> f e"),
    "w_down": ("mlp.down.weight", "f e -> e f"),
}
_TOP = {
    "embed": ("embed.weight", "v e -> v e"),
    "final_norm": ("final_norm.weight", "e -> e"),
    "unembed": ("unembed.weight", "e v -> v e"),
}


def rope_tables(seq: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """HF Llama's rotary ``cos, sin``, each ``(seq, head_dim)`` in float32, for positions ``0..seq-1``.

    ``inv_freq = 1 / theta ** (arange(0, d, 2) / d)``, the angles repeated over both halves (``rotate_half``).

    >>> cos, sin = rope_tables(3, 4, 10000.0, torch.device("cpu"))
    >>> cos[0].tolist(), sin[0].tolist()  # position 0 is not rotated
    ([1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0])
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)  # (head_dim/2,)
    freqs = torch.arange(seq, device=device).float()[:, None] * inv_freq[None, :]  # (seq, head_dim/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (seq, head_dim)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` over the two halves of the last dim (HF Llama's convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: (batch, heads, seq, head_dim)`` by the tables, cast to ``x``'s dtype first as HF does."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # (seq, head_dim): broadcast over batch and heads
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Causal GQA attention with RoPE and ``F.scaled_dot_product_attention``.

    The head counts come from the q/k/v widths, so under tensor parallelism (``ColwiseParallel``
    projections returning local tensors) each rank runs its own ``heads / tp`` query heads on plain
    tensors. ``enable_gqa`` has SDPA read kv head ``h // (heads // kv_heads)`` for query head ``h``,
    Hugging Face's ``repeat_kv`` order (and ``models.layers.attention``'s).
    """

    def __init__(self, cfg: gpt.Config):
        super().__init__()
        q_width, kv_width = cfg.heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
        self.wq = nn.Linear(cfg.dim, q_width, bias=False)
        self.wk = nn.Linear(cfg.dim, kv_width, bias=False)
        self.wv = nn.Linear(cfg.dim, kv_width, bias=False)
        self.wo = nn.Linear(q_width, cfg.dim, bias=False)
        self.d_head = cfg.d_head

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Under TP the projections return this rank's heads only: (batch, seq, heads/tp · head_dim).
        q, k, v = (einops.rearrange(w(x), "b s (h d) -> b h s d", d=self.d_head) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (batch, heads, seq, head_dim)
        return self.wo(einops.rearrange(out, "b h s d -> b s (h d)"))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: gpt.Config):
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.mlp, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.mlp, bias=False)
        self.down = nn.Linear(cfg.mlp, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """``x + attn(attn_norm(x))``, then ``+ mlp(mlp_norm(·))``."""

    def __init__(self, cfg: gpt.Config):
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps), Attention(cfg)
        self.mlp_norm, self.mlp = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps), MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class NativeGpt(nn.Module):
    """The gpt decoder as modules; ``forward(batch)`` returns the mean cross-entropy, ``gpt.loss``'s value."""

    def __init__(self, cfg: gpt.Config):
        super().__init__()
        if cfg.tie_embeddings:
            raise ValueError(
                "NativeGpt: cfg.tie_embeddings=True is not mirrored (a tied unembedding cannot take its own TP "
                "plan). Fix: use a config with tie_embeddings=False."
            )
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.final_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.unembed = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        tokens, labels = batch["tokens"], batch["labels"]  # (batch, seq) each
        # Computed per call, not a buffer: DDP would broadcast a buffer every step.
        cos, sin = rope_tables(tokens.shape[1], self.cfg.d_head, self.cfg.rope_theta, tokens.device)
        x = self.embed(tokens)  # (batch, seq, dim); (batch, seq/tp, dim) under SP
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.unembed(self.final_norm(x))  # (batch, seq, vocab); vocab-sharded under tp_plan
        # Under tp_plan the DTensor logits take loss_parallel's cross-entropy (the caller enters
        # torch.distributed.tensor.parallel.loss_parallel() around forward and backward).
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=self.cfg.ignore_index)


def _to_module(x: torch.Tensor, pattern: str, cfg: gpt.Config) -> torch.Tensor:
    return einops.rearrange(x, pattern, **({"d": cfg.d_head} if " d" in pattern else {}))


def _to_tree(x: torch.Tensor, pattern: str, cfg: gpt.Config) -> torch.Tensor:
    lhs, rhs = pattern.split(" -> ")
    return _to_module(x, f"{rhs} -> {lhs}", cfg)


def from_params(params: gpt.Params, cfg: gpt.Config) -> NativeGpt:
    """A :class:`NativeGpt` holding copies of a ``models.gpt`` parameter tree's weights.

    Args:
        params: a tree from ``gpt.init`` (plain tensors).
        cfg: its config (``tie_embeddings=False``).

    Returns:
        The module; ``model(batch)`` equals ``gpt.loss(params, batch, cfg)`` up to rounding.

    >>> cfg = gpt.Config(layers=1)
    >>> tuple(from_params(gpt.init(core.random.key(0), cfg), cfg).blocks[0].attn.wq.weight.shape)
    (128, 128)
    """
    model = NativeGpt(cfg)
    with torch.no_grad():
        for key, (name, pattern) in _TOP.items():
            model.get_parameter(name).copy_(_to_module(params[key], pattern, cfg))
        for block, p in zip(model.blocks, params["blocks"]):
            for key, (name, pattern) in _BLOCK.items():
                block.get_parameter(name).copy_(_to_module(p[key], pattern, cfg))
    return model


def to_params(model: NativeGpt, grads: bool = False) -> gpt.Params:
    """The model's weights (or, with ``grads``, their ``.grad``) in the ``models.gpt`` tree layout.

    >>> cfg = gpt.Config(layers=1); params = gpt.init(core.random.key(0), cfg)
    >>> torch.equal(to_params(from_params(params, cfg))["blocks"][0]["wo"], params["blocks"][0]["wo"])
    True
    """

    def read(module: nn.Module, name: str, pattern: str) -> torch.Tensor:
        p = module.get_parameter(name)
        return _to_tree((p.grad if grads else p).detach(), pattern, model.cfg)

    top = {key: read(model, name, pattern) for key, (name, pattern) in _TOP.items()}
    blocks = [{key: read(b, name, pattern) for key, (name, pattern) in _BLOCK.items()} for b in model.blocks]
    return {"embed": top["embed"], "blocks": blocks, "final_norm": top["final_norm"], "unembed": top["unembed"]}


def tp_plan(model: NativeGpt) -> dict[str, Any]:
    """torchtitan's Llama tensor/sequence-parallel plan for ``model``, as ``parallelize_module`` takes it.

    The residual stream is ``Shard(1)`` (seq) between blocks; norms run on it (``SequenceParallel``);
    attention and MLP inputs are all-gathered once (``PrepareModuleInput``); q/k/v/gate/up are
    ``ColwiseParallel`` and o/down ``RowwiseParallel`` with a reduce-scatter back to ``Shard(1)``;
    the embedding is row(vocab)-parallel and the unembedding leaves the logits vocab-sharded.

    >>> tp_plan(NativeGpt(gpt.Config(layers=1)))["blocks.0.attn.wo"]
    RowwiseParallel(input_layouts=(Shard(dim=-1),), output_layouts=(Shard(dim=1),), use_local_output=True)
    """
    gather_seq = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    # attention's cos/sin tables are plain (seq, head_dim) tensors, as torchtitan's freqs_cis: passed as they are
    gather_attn = PrepareModuleInput(
        input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
    )
    plan: dict[str, Any] = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "final_norm": SequenceParallel(),
        "unembed": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(len(model.blocks)):
        b = f"blocks.{i}"
        plan |= {f"{b}.attn_norm": SequenceParallel(), f"{b}.mlp_norm": SequenceParallel()}
        plan |= {f"{b}.attn": gather_attn, f"{b}.mlp": gather_seq}
        plan |= {f"{b}.{m}": ColwiseParallel() for m in ("attn.wq", "attn.wk", "attn.wv", "mlp.gate", "mlp.up")}
        plan |= {f"{b}.{m}": RowwiseParallel(output_layouts=Shard(1)) for m in ("attn.wo", "mlp.down")}
    return plan


def parallelize(model: NativeGpt, tp_mesh: DeviceMesh) -> NativeGpt:
    """``parallelize_module(model, tp_mesh, tp_plan(model))`` after checking the sizes divide.

    Raises:
        ShardingError: heads, kv_heads, seq_len, mlp or vocab not divisible by the tp mesh size.

    >>> model = parallelize(from_params(params, cfg), init_device_mesh("cpu", (4,)))  # doctest: +SKIP
    """
    cfg, tp = model.cfg, tp_mesh.size()
    sizes = {"heads": cfg.heads, "kv_heads": cfg.n_kv_heads, "seq_len": cfg.seq_len, "mlp": cfg.mlp, "vocab": cfg.vocab}
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        raise sharding_error(
            f"NativeGpt tensor/sequence parallelism over {tp} ranks needs {sorted(bad)} divisible by {tp}; got {bad}",
            fix=f"pick sizes divisible by {tp}, or a smaller tp mesh",
            mesh=tp_mesh,
        )
    return parallelize_module(model, tp_mesh, tp_plan(model))


def compile_blocks(model: NativeGpt, backend: str) -> NativeGpt:
    """Each block's forward ``torch.compile``d (``backend``, fullgraph): torchtitan's per-block recipe.

    Call it after :func:`parallelize` (the TP plan's hooks on a block's submodules are traced into its graph) and
    before ``fully_shard``/DDP (their hooks, on the block and the root, stay eager around the graphs).

    Under the TP plan the embedding's output (its reduce-scatter, run async, then ``to_local``) is copied before
    the first block: fed to a compiled block as it is, its gradient reached the reduce-scatter's backward as a
    plain tensor on torch 2.13 (``AttributeError: 'Tensor' object has no attribute '_local_tensor'`` in
    ``Redistribute.backward``), with ``aot_eager`` as with inductor. The copy is one (batch, seq/tp, dim) tensor.

    >>> compile_blocks(from_params(params, cfg), "inductor")  # doctest: +SKIP
    """
    for block in model.blocks:
        block.forward = torch.compile(block.forward, backend=backend, fullgraph=True)
    if any(isinstance(p, DTensor) for p in model.embed.parameters()):
        model.embed.register_forward_hook(lambda module, args, out: out.clone())  # after the plan's output hook
    return model
