"""``nn.Module`` models under tensor parallelism: checked ``functional_call``, attention on local heads.

A module you did not write runs on sharded params through ``torch.func.functional_call``; DTensor
follows the layout op by op. Two things in ``torch.nn`` do not follow a tensor-parallel layout:

* **The fused in-projection.** ``nn.MultiheadAttention`` keeps q, k and v in one
  ``in_proj_weight`` of shape ``(3·embed, embed)`` and splits the projection with
  ``unflatten(-1, (3, embed))`` (``aten.view``). Split over ``tp``, a rank's rows are a block of
  ``[q | k | v]``, not whole heads: DTensor refuses the view (``3`` is not divisible by ``tp``) or
  gathers. :func:`functional_call` refuses such a layout before the projection runs, naming the
  parameter; either name the fused dims ``None`` (replicated: the out-projection and the
  feed-forward still split over ``tp``), or convert the module with :func:`local_heads`.
* **CPU attention's backward** had no DTensor strategy; :mod:`shardings.ops.sdpa_strategies`
  registers one (batch or heads split, no communication), imported here.

:func:`local_heads` replaces every ``nn.MultiheadAttention`` by :class:`LocalHeadsAttention`:
the same function with q, k and v as three projections, so ``("heads", "embed")`` splits each
over ``tp`` by whole heads and each rank runs attention on its own heads (Megatron's column- then
row-parallel pair, one reduction after the out-projection). :func:`fused_state_dict` converts
back to ``nn.MultiheadAttention``'s names. Any other DTensor failure inside the call becomes a
:class:`~shardings.ShardingError` naming the op, the submodule running and the mesh
(:func:`dtensor_errors`).
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import einops
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from shardings.ops import assert_strategies, sdpa_strategies  # noqa: F401  (register DTensor strategies)
from shardings.residency.lazy_params import resolve
from shardings.spec.context import current
from shardings.spec.distribute import spec_of
from shardings.spec.errors import sharding_error
from shardings.spec.lower import mesh_of

__all__ = ["LocalHeadsAttention", "dtensor_errors", "functional_call", "fused_state_dict", "local_heads"]

_FIX_MIXED = "pass every tensor the module reads as a DTensor: shardings.constrain(x, names) each input and mask"
_FIX_UNEVEN = (
    "split that dim evenly (a length divisible by the mesh axis, e.g. the sequence under sp: nn.Linear flattens "
    "the dims before the last) or keep it whole; a fused projection (nn.MultiheadAttention's in_proj_weight): "
    "name its first dim None or convert the module with shardings.ops.module_tp.local_heads(module)"
)
_FIX = (
    "name the dims of the weights feeding that op None (a fused projection such as nn.MultiheadAttention's "
    "in_proj_weight), keep the module out of tp, or for nn.MultiheadAttention convert the module with "
    "shardings.ops.module_tp.local_heads(module) to run attention on each rank's own heads"
)
# DTensor's wordings of "no way to run this op on these placements" (torch/distributed/tensor/_dispatch.py,
# _sharding_prop.py): the failing op follows each
_DTENSOR_FAILURES = re.compile(
    r"Sharding propagation failed (?:for|on op) (?:Op\(op=)?(aten\.[\w.]+)"
    r"|Operator (aten\.[\w.]+) does not have a sharding strategy"
    r"|(aten\.[\w.]+):? got mixed torch\.Tensor and DTensor"
)


class LocalHeadsAttention(nn.Module):
    """``nn.MultiheadAttention`` with q, k and v as three projections: tensor parallelism splits heads.

    The same arguments, results and values as ``nn.MultiheadAttention`` (build one with
    :meth:`from_module` or :func:`local_heads`). Name ``{q,k,v}_proj.weight`` ``("heads",
    "embed")``, their biases ``("heads",)`` and ``out_proj.weight`` ``("embed", "heads")``: each
    rank then projects, attends and out-projects its own heads (``num_heads`` must divide by the
    ``tp`` size), with one reduction after the out-projection. ``add_bias_kv`` and
    ``add_zero_attn`` are not supported.
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, device: Any = None, dtype: Any = None):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        self.dropout, self.batch_first = dropout, batch_first
        like = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias, **like)
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias, **like)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias, **like)
        self.out_proj = nn.modules.linear.NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias, **like)
        # read by nn.TransformerEncoderLayer's fast-path checks; as nn.MultiheadAttention with separate
        # projections has them, so the fused inference kernel (which needs in_proj_weight) is never tried
        self._qkv_same_embed_dim = False
        self.register_parameter("in_proj_weight", None)
        self.register_parameter("in_proj_bias", None)

    @classmethod
    def from_module(cls, mha: nn.MultiheadAttention) -> LocalHeadsAttention:
        """The same attention (same values, training mode) from an ``nn.MultiheadAttention``.

        Raises:
            ValueError: ``mha`` has ``add_bias_kv`` or ``add_zero_attn``.
        """
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError("LocalHeadsAttention does not support add_bias_kv or add_zero_attn; keep this "
                             "nn.MultiheadAttention and name its in_proj_weight's dims None")
        bias = mha.out_proj.bias is not None
        weight = mha.out_proj.weight
        new = cls(mha.embed_dim, mha.num_heads, mha.dropout, bias, mha.kdim, mha.vdim, mha.batch_first,
                  weight.device, weight.dtype)
        with torch.no_grad():
            if mha._qkv_same_embed_dim:
                weights = mha.in_proj_weight.chunk(3)  # (3·embed, embed) = [q | k | v]
            else:
                weights = (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)
            biases = mha.in_proj_bias.chunk(3) if bias else (None,) * 3
            for proj, w, b in zip((new.q_proj, new.k_proj, new.v_proj), weights, biases):
                proj.weight.copy_(w)
                if b is not None:
                    proj.bias.copy_(b)
            new.out_proj.load_state_dict(mha.out_proj.state_dict())
        return new.train(mha.training)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As ``nn.MultiheadAttention.forward``: ``(output, weights or None)``."""
        batched = query.dim() == 3
        if not batched:  # (seq, embed): one example
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # (seq, batch, embed) -> (batch, seq, embed)
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        if is_causal and attn_mask is None:
            raise RuntimeError("is_causal is a hint and needs attn_mask, as for nn.MultiheadAttention "
                               "(nn.Transformer.generate_square_subsequent_mask makes one)")
        causal = is_causal and key_padding_mask is None and not need_weights  # the hint suffices: as torch
        mask = None if causal else self._mask(attn_mask, key_padding_mask, query)
        heads = "b s (h d) -> b h s d"  # (batch, seq, embed) -> (batch, heads, seq, head_dim)
        q = einops.rearrange(self.q_proj(query), heads, h=self.num_heads)
        k = einops.rearrange(self.k_proj(key), heads, h=self.num_heads)
        v = einops.rearrange(self.v_proj(value), heads, h=self.num_heads)
        dropout = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = einops.einsum(q, k, "b h s d, b h t d -> b h s t") * self.head_dim**-0.5
            weights = F.dropout((scores if mask is None else scores + mask).softmax(-1), dropout)
            out = einops.einsum(weights, v, "b h s t, b h t d -> b h s d")
            weights = weights.mean(1) if average_attn_weights else weights
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal)
        out = self.out_proj(einops.rearrange(out, "b h s d -> b s (h d)"))  # (batch, seq, embed)
        if not batched:
            return out.squeeze(0), None if weights is None else weights.squeeze(0)
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def _mask(self, attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None,
              query: torch.Tensor) -> torch.Tensor | None:
        """Both masks as one additive float mask broadcasting to ``(batch, heads, seq_q, seq_k)``."""
        mask = None
        if attn_mask is not None:  # (seq_q, seq_k) or (batch·heads, seq_q, seq_k); bool: True = masked out
            mask = _additive(attn_mask, query.dtype)
            mask = mask.view(-1, self.num_heads, *mask.shape[1:]) if mask.dim() == 3 else mask
        if key_padding_mask is not None:  # (batch, seq_k) -> (batch, 1, 1, seq_k)
            padding = _additive(key_padding_mask, query.dtype)[:, None, None, :]
            mask = padding if mask is None else mask + padding
        return mask


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill(mask, float("-inf"))
    return mask.to(dtype)


def local_heads(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with every ``nn.MultiheadAttention`` replaced by :class:`LocalHeadsAttention`.

    The copy computes the same function with the same values; its parameters are named
    ``...{q,k,v}_proj.{weight,bias}`` where the original had ``...in_proj_{weight,bias}``
    (:func:`fused_state_dict` converts back). ``module`` is not changed.

    >>> layer = local_heads(torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True))
    >>> sorted(k for k in dict(layer.named_parameters()) if k.startswith("self_attn"))[:2]
    ['self_attn.k_proj.bias', 'self_attn.k_proj.weight']
    """
    if isinstance(module, nn.MultiheadAttention):
        return LocalHeadsAttention.from_module(module)
    module = copy.deepcopy(module)
    for name, sub in list(module.named_modules()):
        if isinstance(sub, nn.MultiheadAttention):
            parent, _, child = name.rpartition(".")
            setattr(module.get_submodule(parent), child, LocalHeadsAttention.from_module(sub))
    return module


def fused_state_dict(module: nn.Module, params: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``params`` (default ``module.state_dict()``) renamed for the module before :func:`local_heads`.

    Each :class:`LocalHeadsAttention` of ``module`` gets its q, k and v projections back as
    ``in_proj_weight`` (or ``{q,k,v}_proj_weight`` when ``kdim``/``vdim`` differ) and
    ``in_proj_bias``, in the original order; every other entry is kept. Pass whole tensors
    (``shardings.gather`` first).

    >>> original.load_state_dict(fused_state_dict(local_heads(original)))  # doctest: +SKIP
    """
    params = dict(module.state_dict() if params is None else params)
    fused: dict[str, dict[str, torch.Tensor]] = {}  # the entry each q_proj entry becomes (and k, v are dropped)
    for name, sub in module.named_modules():
        if not isinstance(sub, LocalHeadsAttention):
            continue
        at = f"{name}." if name else ""
        weights = [params.pop(f"{at}{p}_proj.weight") for p in "kv"]
        q = params[f"{at}q_proj.weight"]
        if sub.kdim == sub.vdim == sub.embed_dim:
            fused[f"{at}q_proj.weight"] = {f"{at}in_proj_weight": torch.cat([q, *weights])}  # (3·embed, embed)
        else:
            fused[f"{at}q_proj.weight"] = {f"{at}{p}_proj_weight": w for p, w in zip("qkv", [q, *weights])}
        if sub.q_proj.bias is not None:
            biases = [params[f"{at}q_proj.bias"], *(params.pop(f"{at}{p}_proj.bias") for p in "kv")]
            fused[f"{at}q_proj.bias"] = {f"{at}in_proj_bias": torch.cat(biases)}
    return {k: v for key, value in params.items() for k, v in fused.get(key, {key: value}).items()}


def functional_call(module: nn.Module, params: Mapping[str, torch.Tensor], args: Any = (),
                    kwargs: dict[str, Any] | None = None) -> Any:
    """``torch.func.functional_call``, checked against the layout before each attention runs.

    Before an ``nn.MultiheadAttention`` runs, its fused ``in_proj_{weight,bias}`` must not be split
    on their fused dim, and a :class:`LocalHeadsAttention`'s heads must divide over the axes that
    split its projections; a DTensor failure inside the call is translated by :func:`dtensor_errors`
    with the path of the submodule running. Nothing is checked for plain tensors (one device, or a
    data-parallel layout's local step).

    Raises:
        ShardingError: a layout attention cannot follow, before that attention runs (so before
            the first optimizer step); or an op DTensor cannot run on the layout's placements.

    >>> logits = functional_call(module, params, (x,))  # doctest: +SKIP
    """
    running: list[str] = []  # the submodules entered and not yet left: the last one failed, if any

    def enter(name: str, sub: nn.Module) -> Any:
        def hook(*_: Any) -> None:
            running.append(name)
            _check_attention(name, sub)
        return hook

    def leave(*_: Any) -> None:
        running.pop()

    handles = []
    try:
        for name, sub in module.named_modules():
            handles += [sub.register_forward_pre_hook(enter(name, sub)), sub.register_forward_hook(leave)]
        with dtensor_errors(where=lambda: running[-1] if running else None):
            return torch.func.functional_call(module, dict(params), args, kwargs)
    finally:
        for handle in handles:
            handle.remove()


def _check_attention(name: str, sub: nn.Module) -> None:
    """Refuse, before ``sub`` runs, an attention layout that cannot keep whole heads on each rank."""
    at = f"{name}." if name else ""
    if isinstance(sub, nn.MultiheadAttention):
        for leaf in ("in_proj_weight", "in_proj_bias"):
            x = resolve(getattr(sub, leaf))  # about to be used: a ZeRO-3 placeholder is gathered now
            if isinstance(x, DTensor) and any(isinstance(p, Shard) and p.dim == 0 for p in x.placements):
                raise sharding_error(
                    "nn.MultiheadAttention splits its fused in-projection [q | k | v] with "
                    "unflatten(-1, (3, embed_dim)) (aten.view in F.multi_head_attention_forward); split over "
                    "the mesh, a rank's rows are a block of [q | k | v], not whole heads of each",
                    path=at + leaf, spec=spec_of(x), mesh=mesh_of(x),
                    fix="name in_proj_weight's and in_proj_bias's first dim None (the out-projection and the "
                    "feed-forward still split over tp), keep the module out of tp, or convert it with "
                    "shardings.ops.module_tp.local_heads(module) to run attention on each rank's own heads",
                )
    elif isinstance(sub, LocalHeadsAttention):
        for proj in ("q_proj", "k_proj", "v_proj"):
            x = resolve(getattr(sub, proj).weight)
            if not isinstance(x, DTensor):
                continue
            splits = [i for i, p in enumerate(x.placements) if isinstance(p, Shard) and p.dim == 0]
            ranks = math.prod([x.device_mesh.size(i) for i in splits])
            if sub.num_heads % ranks:
                axes = tuple(x.device_mesh.mesh_dim_names[i] for i in splits)
                raise sharding_error(
                    f"{sub.num_heads} heads do not split into whole heads over {ranks} ranks "
                    f"(the output dim of {proj}.weight is split over {axes})",
                    path=f"{at}{proj}.weight", spec=spec_of(x), mesh=mesh_of(x),
                    fix=f"use a mesh whose {axes} size divides num_heads ({sub.num_heads}), or name the q, k "
                    "and v projections' output dims and out_proj.weight's input dim None",
                )


@contextlib.contextmanager
def dtensor_errors(where: Callable[[], str | None] | None = None) -> Iterator[None]:
    """Turn DTensor's "cannot run this op on these placements" into a :class:`~shardings.ShardingError`.

    The error names the op, the active mesh (:func:`shardings.use`) and, when ``where()`` (a
    callable) gives it, the submodule running; the original exception is its ``__cause__``.
    Other exceptions pass unchanged. ``train_step`` can wrap its forward and backward in it.

    >>> with dtensor_errors():  # doctest: +SKIP
    ...     loss = loss_fn(params, batch)
    """
    try:
        yield
    except (RuntimeError, NotImplementedError) as e:
        found = _DTENSOR_FAILURES.search(str(e))
        if found is None:
            raise
        op = next(g for g in found.groups() if g)
        reason = str(e).split("\n")[0].strip()
        name = where() if where is not None else None
        ctx = current()
        raise sharding_error(
            f"DTensor cannot run {op} on the layout's placements ({reason})",
            path=None if name is None else f"module {name or '<root>'!r}",
            mesh=ctx.mesh if ctx is not None else None,
            fix=_FIX_MIXED if found.group(3) else _FIX_UNEVEN if "unevenly" in reason else _FIX,
        ) from e
