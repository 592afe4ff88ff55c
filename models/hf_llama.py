"""Conversion between :mod:`models.gpt` parameters and Hugging Face ``LlamaForCausalLM`` state dicts.

One table drives both directions: for every parameter, its HF key and the einops patterns of the
two layouts. HF ``nn.Linear`` weights are ``(out, in)`` with heads flattened into ``out``/``in``;
ours are ``(in, out)`` with heads as their own dims. Letters: ``v`` vocab, ``e`` dim, ``h`` heads,
``k`` kv_heads, ``d`` head_dim, ``m`` mlp. ``transformers`` is only imported by the config helpers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import einops
import torch

from core import tree

if TYPE_CHECKING:
    from models.gpt import Config

__all__ = ["config_from_hf", "from_hf_llama", "hf_config", "to_hf_llama"]

# our name -> (HF key suffix, HF layout, our layout)
_BLOCK = {
    "attn_norm": ("input_layernorm.weight", "e", "e"),
    "wq": ("self_attn.q_proj.weight", "(h d) e", "e h d"),
    "wk": ("self_attn.k_proj.weight", "(k d) e", "e k d"),
    "wv": ("self_attn.v_proj.weight", "(k d) e", "e k d"),
    "wo": ("self_attn.o_proj.weight", "e (h d)", "h d e"),
    "mlp_norm": ("post_attention_layernorm.weight", "e", "e"),
    "w_gate": ("mlp.gate_proj.weight", "m e", "e m"),
    "w_up": ("mlp.up_proj.weight", "m e", "e m"),
    "w_down": ("mlp.down_proj.weight", "e m", "m e"),
}
_TOP = {
    "embed": ("model.embed_tokens.weight", "v e", "v e"),
    "final_norm": ("model.norm.weight", "e", "e"),
    "unembed": ("lm_head.weight", "v e", "e v"),
}


def _sizes(cfg: Config) -> dict[str, int]:
    return {"v": cfg.vocab, "e": cfg.dim, "h": cfg.heads, "k": cfg.n_kv_heads, "d": cfg.d_head, "m": cfg.mlp}


def _shape(layout: str, sizes: dict[str, int]) -> tuple[int, ...]:
    """The shape a layout denotes: ``"(h d) e"`` -> ``(h·d, e)``."""
    groups = re.findall(r"\(([^)]*)\)|(\w)", layout)
    return tuple(math.prod(sizes[a] for a in group.split()) if group else sizes[single] for group, single in groups)


def _convert(x: torch.Tensor, src: str, dst: str, sizes: dict[str, int], where: str) -> torch.Tensor:
    expected = _shape(src, sizes)
    if tuple(x.shape) != expected:
        raise ValueError(
            f"{where}: shape {tuple(x.shape)} does not match the config, expected {expected} (layout '{src}'). "
            f"Fix: build the gpt.Config from the checkpoint's own config (config_from_hf)."
        )
    used = {a: n for a, n in sizes.items() if a in src}
    return einops.rearrange(x, f"{src} -> {dst}", **used).contiguous()


def _layout(cfg: Config) -> dict[str, Any]:
    """The params tree of ``cfg`` with an ``(HF key, HF layout, our layout)`` entry at each leaf.

    Same structure *and key order* as ``gpt.init``: torch pytrees compare dicts by key order.
    """
    blocks = [
        {name: (f"model.layers.{i}.{key}", hf, ours) for name, (key, hf, ours) in _BLOCK.items()}
        for i in range(cfg.layers)
    ]
    out = {"embed": _TOP["embed"], "blocks": blocks, "final_norm": _TOP["final_norm"]}
    if not cfg.tie_embeddings:
        out["unembed"] = _TOP["unembed"]
    return out


def _is_entry(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 3 and all(isinstance(a, str) for a in x)


def _leaf_at(params: Any, path: tree.KeyPath, where: str) -> torch.Tensor:
    # Look up by key rather than zipping leaves, so params with another dict key order still convert.
    try:
        for entry in path:
            params = params[entry.key if hasattr(entry, "key") else entry.idx]  # MappingKey / SequenceKey
    except (KeyError, IndexError, TypeError) as err:
        raise ValueError(
            f"to_hf_llama: {where} is missing from params. Fix: pass params with gpt.init(key, cfg)'s structure."
        ) from err
    return params


def from_hf_llama(state_dict: Mapping[str, torch.Tensor], cfg: Config) -> dict[str, Any]:
    """Convert a Hugging Face ``LlamaForCausalLM`` state dict into :mod:`models.gpt` parameters.

    Args:
        state_dict: ``model.state_dict()`` of a ``LlamaForCausalLM`` (rotary buffers may be absent).
        cfg: the matching config, e.g. ``config_from_hf(model.config)``.

    Returns:
        A parameter tree as produced by ``gpt.init(key, cfg)``.

    Raises:
        ValueError: a missing key, a shape that does not match ``cfg``, or an ``lm_head.weight``
            that differs from the embedding while ``cfg.tie_embeddings`` is set.

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> hf = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1))
    >>> params = from_hf_llama(hf.state_dict(), config_from_hf(hf.config))
    >>> tuple(params["blocks"][0]["wq"].shape)
    (64, 4, 16)
    """
    sizes = _sizes(cfg)

    def leaf(entry: tuple[str, str, str]) -> torch.Tensor:
        key, hf, ours = entry
        if key not in state_dict:
            raise ValueError(
                f"from_hf_llama: key {key!r} is missing from the state dict ({len(state_dict)} keys). "
                f"Fix: pass a LlamaForCausalLM state dict whose config matches cfg "
                f"(layers={cfg.layers}, tie_embeddings={cfg.tie_embeddings})."
            )
        return _convert(state_dict[key], hf, ours, sizes, key)

    params = tree.map(leaf, _layout(cfg), is_leaf=_is_entry)
    head = state_dict.get(_TOP["unembed"][0])
    if cfg.tie_embeddings and head is not None and not torch.equal(head, params["embed"]):
        raise ValueError(
            "from_hf_llama: cfg.tie_embeddings is set but 'lm_head.weight' differs from "
            "'model.embed_tokens.weight'. Fix: use tie_embeddings=False for this checkpoint."
        )
    return params


def to_hf_llama(params: Mapping[str, Any], cfg: Config) -> dict[str, torch.Tensor]:
    """Convert :mod:`models.gpt` parameters into a ``LlamaForCausalLM`` state dict.

    With ``cfg.tie_embeddings``, ``"lm_head.weight"`` is the embedding tensor itself, so the
    result loads with ``load_state_dict(strict=True)`` either way.

    Args:
        params: a parameter tree of ``gpt.init(key, cfg)``'s structure.
        cfg: its config.

    Returns:
        A dict of HF key -> tensor in HF's ``(out, in)`` layout.

    >>> import core
    >>> from models import gpt
    >>> cfg = gpt.Config(layers=1)
    >>> sd = to_hf_llama(gpt.init(core.random.key(0), cfg), cfg)
    >>> tuple(sd["model.layers.0.self_attn.k_proj.weight"].shape)  # (kv_heads·head_dim, dim)
    (128, 128)
    """
    sizes = _sizes(cfg)
    out = {}
    for path, (key, hf, ours) in tree.leaves_with_path(_layout(cfg), is_leaf=_is_entry):
        where = f"params{tree.keystr(path)}"
        out[key] = _convert(_leaf_at(params, path, where), ours, hf, sizes, where)
    if cfg.tie_embeddings:
        out[_TOP["unembed"][0]] = out[_TOP["embed"][0]]
    return out


def config_from_hf(config: Any, **overrides: Any) -> Config:
    """A :class:`models.gpt.Config` equivalent to a ``transformers.LlamaConfig``.

    ``seq_len`` becomes ``max_position_embeddings`` unless overridden.

    Raises:
        ValueError: features the model does not have (biases, a non-SiLU activation, RoPE scaling).

    >>> from transformers import LlamaConfig
    >>> config_from_hf(LlamaConfig(hidden_size=64, num_attention_heads=4), layers=1).d_head
    16
    """
    from models.gpt import Config

    rope = dict(getattr(config, "rope_parameters", None) or {})
    unsupported = {
        "attention_bias": getattr(config, "attention_bias", False),
        "mlp_bias": getattr(config, "mlp_bias", False),
        "hidden_act != 'silu'": config.hidden_act != "silu",
        "rope_type != 'default'": rope.get("rope_type", "default") != "default",
    }
    bad = [name for name, present in unsupported.items() if present]
    if bad:
        raise ValueError(
            f"config_from_hf: {', '.join(bad)} not supported by models.gpt. "
            f"Fix: convert a plain Llama config (no biases, SiLU, default RoPE)."
        )
    fields = {
        "vocab": config.vocab_size,
        "dim": config.hidden_size,
        "layers": config.num_hidden_layers,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": getattr(config, "head_dim", None),
        "mlp": config.intermediate_size,
        "seq_len": config.max_position_embeddings,
        "rope_theta": float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
        "norm_eps": config.rms_norm_eps,
        "tie_embeddings": bool(config.tie_word_embeddings),
        "init_std": config.initializer_range,
    }
    return Config(**(fields | overrides))


def hf_config(cfg: Config, **overrides: Any) -> Any:
    """A ``transformers.LlamaConfig`` for ``cfg`` (eager attention, no biases), for parity and export.

    >>> from models import gpt
    >>> hf_config(gpt.Config(layers=1)).num_hidden_layers
    1
    """
    from transformers import LlamaConfig

    fields = {
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.d_head,
        "intermediate_size": cfg.mlp,
        "max_position_embeddings": cfg.seq_len,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "hidden_act": "silu",
        "attn_implementation": "eager",
    }
    return LlamaConfig(**(fields | overrides))
