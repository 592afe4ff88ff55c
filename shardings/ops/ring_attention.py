"""Attention that follows the layout: ring attention (context parallelism) when ``seq`` is sharded.

:func:`attention` is what models call; every path runs a fused kernel
(:mod:`shardings.ops.attention_kernels`: ``F.scaled_dot_product_attention``, or the flash kernel's
block form that also returns the log-sum-exp), so no ``seq × seq`` scores are ever saved.
:func:`reference_attention` (explicit einsums, float32 masked softmax) is what the tests compare it
against. Outside a mesh, the kernel runs on the tensors. When the active rules leave the query's
``seq`` dim whole (dp, tp, ...), it runs on each rank's (batch, heads) blocks under
:func:`shard_map`: attention is local to a rank's heads, so no communication. When the rules put
``seq`` on a mesh axis (preset ``cp``), it runs inside :func:`shard_map` over that axis:

* **ring** (default): each rank keeps its query block; K/V blocks travel around the axis with
  ``ppermute`` (``cp − 1`` steps); each block's output and log-sum-exp come from the kernel and
  merge by the online-softmax rule. The backward (a ``torch.autograd.Function``) passes K/V around
  again with the dK/dV accumulators in the same message (``cp`` steps: the last carries dK/dV
  alone, home); each block's part comes from the kernel's backward given the merged output and
  log-sum-exp. No rank ever holds the full K/V, in forward or backward, and no received block is
  saved for backward, compiled or not (:func:`_pack`).
* **all-gather** (preset ``cp_allgather``): K/V are all-gathered over the axis (their gradients
  reduce-scattered back) and the kernel runs with a ``(L, cp·L)`` boolean mask; simpler, ``cp``
  times the K/V memory.

The variant is a rule, so layouts stay rule tables: the logical name ``kv_seq`` is the seq dim of
K/V *as attention consumes them*: on the query's seq axis → ring; replicated → all-gather. A
table without a ``kv_seq`` rule gets the ring.

**Load balance.** With a causal mask, contiguous blocks give rank ``r`` ``r + 1`` blocks of work.
Inside the shard_map the sequence is cut into ``2·cp`` chunks and rank ``r`` computes chunks
``r`` and ``2·cp − 1 − r`` (zigzag / head-tail): every rank computes exactly ``2·cp + 1``
unmasked chunk-pair blocks, and each ring step costs every rank the same. The reordering is
internal (one chunk permutation of q/k/v in, one of the output back, both ``ppermute``s that
show up as ``all_to_all`` in :func:`shardings.comms`), so the rest of the model sees tokens in
natural order: RoPE positions (computed from global indices on the global-view DTensor) and the
loss need no change.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import einops
import torch
from torch.distributed.tensor import DTensor

from shardings.comm.accounting import recorded_as
from shardings.comm.collectives import all_gather, axis_index, axis_size, bind_mesh, ppermute
from shardings.comm.shard_map import shard_map
from shardings.ops import attention_kernels as kernels
from shardings.runtime.compat import maybe_run_for_local_tensor
from shardings.spec.context import constrain, current
from shardings.spec.errors import sharding_error
from shardings.spec.mesh import Mesh, P
from shardings.spec.rules import logical_to_spec

__all__ = ["KV_NAMES", "Q_NAMES", "attention", "reference_attention", "ring_work"]

Q_NAMES = ("batch", "seq", "heads", "head_dim")
KV_NAMES = ("batch", "kv_seq", "kv_heads", "head_dim")
_ALL, _HEAD, _TAIL = slice(0, 2), slice(0, 1), slice(1, 2)  # local halves: [chunk r | chunk 2n-1-r]


def _arange(x: torch.Tensor, n: int) -> torch.Tensor:
    # Built from x (not torch.arange) so it is a LocalTensor/DTensor when x is one.
    return x.new_ones(n, dtype=torch.int64).cumsum(0) - 1


def _softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``softmax(q kᵀ / √d) v`` with K/V already repeated to ``heads``; ``mask: (seq_q, seq_k)``, True = visible."""
    scores = einops.einsum(q, k, "b s h d, b t h d -> b h s t") * (q.shape[-1] ** -0.5)
    scores = scores.float() if mask is None else torch.where(mask, scores.float(), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)  # (batch, heads, seq_q, seq_k)
    return einops.einsum(probs, v, "b h s t, b t h d -> b s h d")


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    # GQA: query head h reads kv head h // groups (HF repeat_kv order: kv-major).
    return einops.repeat(x, "b t k d -> b t (k g) d", g=heads // x.shape[2])  # (batch, seq, heads, head_dim)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True) -> torch.Tensor:
    """Multi-head attention with grouped K/V (MHA, GQA, MQA) on whole sequences: the reference.

    Explicit einsums and a float32 masked softmax (not ``scaled_dot_product_attention``), so the
    same code runs on DTensors whose heads are sharded; repeated K/V are constrained to ``heads``.

    Args:
        q: ``(batch, seq, heads, head_dim)``.
        k: ``(batch, seq, kv_heads, head_dim)``; ``kv_heads`` divides ``heads``.
        v: like ``k``.
        causal: query ``s`` sees keys ``t <= s`` only.

    Returns:
        ``(batch, seq, heads, head_dim)``.

    >>> q = torch.randn(1, 5, 4, 8); kv = torch.randn(1, 5, 2, 8)
    >>> reference_attention(q, kv, kv).shape
    torch.Size([1, 5, 4, 8])
    """
    k = constrain(_repeat_kv(k, q.shape[2]), Q_NAMES)
    v = constrain(_repeat_kv(v, q.shape[2]), Q_NAMES)
    return _whole_seq_attention(q, k, v, causal)


def _whole_seq_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    mask = None
    if causal:  # (seq_q, seq_k): query s sees keys t <= s; longer k/v hold a prefix: the queries are the last ones
        mask = _arange(q, q.shape[1])[:, None] + (k.shape[1] - q.shape[1]) >= _arange(q, k.shape[1])[None, :]
    return _softmax_attention(q, k, v, mask)


def _local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """One rank's blocks (plain tensors, whole sequences) by the fused kernel."""
    return kernels.fused(q, k, v, causal=causal)


# -- the zigzag schedule ----------------------------------------------------------------------------


def _owner(chunk: int, n: int) -> int:
    """The rank that computes ``chunk`` (of ``2n``) in zigzag order: chunks ``r`` and ``2n-1-r`` go to ``r``."""
    return chunk if chunk < n else 2 * n - 1 - chunk


def _schedule(rank: int, step: int, n: int, causal: bool) -> tuple[slice, slice, bool]:
    """Which local query halves meet which K/V halves at ring ``step``, and whether to mask.

    At ``step`` rank ``r`` holds the K/V of rank ``j = r − step`` (zigzag chunks ``j, 2n−1−j``).
    ``j == r``: the diagonal, masked. ``j < r``: every query sees the head chunk ``j`` only.
    ``j > r``: only the tail query chunk ``2n−1−r`` sees anything, and it sees both K/V chunks.
    Every non-diagonal step is two chunk-pair blocks on every rank.
    """
    if not causal:
        return _ALL, _ALL, False
    j = (rank - step) % n
    if j == rank:
        return _ALL, _ALL, True
    return (_ALL, _HEAD, False) if j < rank else (_TAIL, _ALL, False)


def _chunks(rank: int, n: int) -> tuple[int, int]:
    return rank, 2 * n - 1 - rank


def ring_work(cp: int, causal: bool = True) -> list[int]:
    """Unmasked score blocks (chunk pairs of ``seq / 2cp`` tokens) each rank computes in one ring pass.

    Read off the schedule the ring kernel runs; a block counts when some query in it sees some key.

    >>> ring_work(4)
    [9, 9, 9, 9]
    """
    work = [0] * cp
    for r in range(cp):
        for step in range(cp):
            q_half, kv_half, _ = _schedule(r, step, cp, causal)
            j = (r - step) % cp
            for qc in _chunks(r, cp)[q_half]:
                work[r] += sum(kc <= qc or not causal for kc in _chunks(j, cp)[kv_half])
    return work


# -- the per-rank blocks (plain tensors; run once per simulated rank) -------------------------------


def _rows(half: slice, c: int) -> slice:
    return slice(half.start * c, half.stop * c)


@maybe_run_for_local_tensor
def _forward_block(q, k, v, out, lse, rank, step: int, n: int, causal: bool, scale: float):
    """Merge one K/V block into this rank's running ``out (b, L, h, d)`` and ``lse (b, h, L)`` (accumulator dtype).

    The diagonal block is causal top-left: a rank's zigzag chunks ``r < 2n−1−r`` keep positions increasing.
    """
    q_half, kv_half, masked = _schedule(int(rank), step, n, causal)
    c = q.shape[1] // 2
    qi, ki = _rows(q_half, c), _rows(kv_half, c)
    o, block_lse = kernels.block_forward(q[:, qi], k[:, ki], v[:, ki], masked, scale)
    new_lse = torch.logaddexp(lse[..., qi], block_lse)
    to_rows = lambda w: einops.rearrange(torch.exp(w - new_lse), "b h s -> b s h 1")
    out, lse = out.clone(), lse.clone()
    out[:, qi] = out[:, qi] * to_rows(lse[..., qi]) + o * to_rows(block_lse)
    lse[..., qi] = new_lse
    return out, lse


@maybe_run_for_local_tensor
def _backward_block(q, kv, dout, out, lse, dq, dkv, rank, step: int, n: int, causal: bool, scale: float):
    """Add one block's part to ``dq`` and to the travelling ``dkv`` (accumulator dtype), from the merged out/lse."""
    q_half, kv_half, masked = _schedule(int(rank), step, n, causal)
    c = q.shape[1] // 2
    qi, ki = _rows(q_half, c), _rows(kv_half, c)
    dq_, dk_, dv_ = kernels.block_backward(dout[:, qi], q[:, qi], kv[0][:, ki], kv[1][:, ki], out[:, qi], lse[..., qi],
                                           masked, scale)
    dq, dkv = dq.clone(), dkv.clone()
    dq[:, qi] += dq_
    dkv[0][:, ki] += dk_
    dkv[1][:, ki] += dv_
    return dq, dkv


# -- the ring (inside shard_map) --------------------------------------------------------------------


class _Ring(NamedTuple):
    mesh: Mesh
    axis: str | tuple[str, ...]
    label: str  # the axis as shardings.comms reports it
    causal: bool

    def send(self, x: torch.Tensor) -> torch.Tensor:
        """Pass ``x`` one step around the ring (to axis index + 1), counted as one ``ppermute``."""
        n = axis_size(self.axis)
        with recorded_as("ppermute", self.label, x):
            return ppermute(x, self.axis, [(i, (i + 1) % n) for i in range(n)])


def _pack(kv: torch.Tensor, dkv: torch.Tensor) -> torch.Tensor:
    """K/V and the dK/dV accumulators as one message (their bytes: the dtypes may differ), what backward sends.

    One message makes backward's re-send of K/V depend on the gradient, so a compiled step runs it in backward as
    eager does and saves no received block (nor does the planner's cp memory model). Sent alone, it depends on
    forward's values only, and AOTAutograd (torch 2.13) keeps what forward received: its CSE merges it with forward's
    equal send (``fx_graph_cse`` spares random ops, ``aten.empty`` and outputs, no tag opts out); with ``config.cse``
    off, the min-cut partitioner runs it in forward (a collective is never recomputed), saves its result and keeps a
    dead copy in backward. It also sends ``cp``, not ``2·cp − 1``, messages per backward, of the same bytes.
    """
    # dK/dV first: their dtype (the accumulator's) is the wider, so K/V's bytes start aligned for their dtype
    return torch.cat((dkv.reshape(-1).view(torch.uint8), kv.reshape(-1).view(torch.uint8)))


def _unpack(message: torch.Tensor, kv: torch.Tensor, dkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`_pack`: ``(kv, dkv)``, shaped like the ones that were packed."""
    cut = dkv.numel() * dkv.element_size()
    return message[cut:].view(kv.dtype).view(kv.shape), message[:cut].view(dkv.dtype).view(dkv.shape)


class _RingAttention(torch.autograd.Function):
    """Ring attention on zigzag-ordered local blocks; K/V (and dK/dV in backward) travel by ``ppermute``."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring) -> torch.Tensor:
        n, rank, scale = axis_size(ring.axis), axis_index(ring.axis), q.shape[-1] ** -0.5
        acc = kernels.accumulator(q.dtype)
        out = q.new_zeros(q.shape, dtype=acc)  # (b, L, h, d)
        lse = q.new_full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc)  # (b, h, L)
        kv = torch.stack((k, v))  # (2, b, L, kv_heads, d): one buffer per ring step
        for step in range(n):
            nxt = ring.send(kv) if step < n - 1 else None
            out, lse = _forward_block(q, kv[0], kv[1], out, lse, rank, step, n, ring.causal, scale)
            kv = nxt
        out = out.to(q.dtype)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        with bind_mesh(ring.mesh):  # backward runs after shard_map returned: name the axis again
            n, rank, scale = axis_size(ring.axis), axis_index(ring.axis), q.shape[-1] ** -0.5
            dout, acc = dout.to(q.dtype), kernels.accumulator(q.dtype)
            dq = torch.zeros_like(q, dtype=acc)
            kv = torch.stack((k, v))
            dkv = torch.zeros_like(kv, dtype=acc)  # travels with kv, accumulating every rank's part
            for step in range(n):
                dq, dkv = _backward_block(q, kv, dout, out, lse, dq, dkv, rank, step, n, ring.causal, scale)
                if step < n - 1:  # K/V and dK/dV as one message: _pack says why
                    kv, dkv = _unpack(ring.send(_pack(kv, dkv)), kv, dkv)
                else:
                    dkv = ring.send(dkv)  # the last step brings dK/dV home
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def _zigzag_perms(n: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Contiguous rank ``r`` holds chunks ``2r, 2r+1``: where its even and its odd chunk go."""
    return [(r, _owner(2 * r, n)) for r in range(n)], [(r, _owner(2 * r + 1, n)) for r in range(n)]


def _move(x: torch.Tensor, axis: Any, perm: list[tuple[int, int]]) -> torch.Tensor:
    return x if all(s == d for s, d in perm) else ppermute(x, axis, perm)


def _to_zigzag(x: torch.Tensor, axis: Any) -> torch.Tensor:
    """``(b, L, ...)`` contiguous block of rank ``r`` → chunks ``[r, 2n−1−r]`` (each rank gets one even, one odd)."""
    even_perm, odd_perm = _zigzag_perms(axis_size(axis))
    even, odd = x.chunk(2, dim=1)
    even, odd = _move(even, axis, even_perm), _move(odd, axis, odd_perm)
    r_is_even = (axis_index(axis) % 2 == 0).to(x.device)  # chunk r has r's parity; chunk 2n-1-r the other
    return torch.cat((torch.where(r_is_even, even, odd), torch.where(r_is_even, odd, even)), dim=1)


def _from_zigzag(x: torch.Tensor, axis: Any) -> torch.Tensor:
    """The inverse of :func:`_to_zigzag`."""
    even_perm, odd_perm = _zigzag_perms(axis_size(axis))
    head, tail = x.chunk(2, dim=1)
    r_is_even = (axis_index(axis) % 2 == 0).to(x.device)
    even, odd = torch.where(r_is_even, head, tail), torch.where(r_is_even, tail, head)
    inverse = lambda perm: [(d, s) for s, d in perm]
    return torch.cat((_move(even, axis, inverse(even_perm)), _move(odd, axis, inverse(odd_perm))), dim=1)


def _ring_local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring) -> torch.Tensor:
    if not ring.causal:  # no mask, no imbalance: contiguous blocks as they are
        return _RingAttention.apply(q, k, v, ring)
    heads, kv_heads = q.shape[2], k.shape[2]
    qkv = _to_zigzag(torch.cat((q, k, v), dim=2), ring.axis)  # one relayout for the three
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=2)
    return _from_zigzag(_RingAttention.apply(q, k, v, ring), ring.axis)


def _allgather_local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring) -> torch.Tensor:
    length = q.shape[1]
    k = all_gather(k, ring.axis, axis=1, tiled=True)  # (b, n·L, kv_heads, d); backward: reduce-scatter
    v = all_gather(v, ring.axis, axis=1, tiled=True)
    mask = None
    if ring.causal:  # (L, n·L) booleans: this rank's queries sit at rank·L + s
        q_pos = axis_index(ring.axis).to(q.device) * length + _arange(q, length)  # global positions
        mask = q_pos[:, None] >= _arange(q, k.shape[1])[None, :]
    return kernels.fused(q, k, v, causal=False, mask=mask)


# -- the public entry point -------------------------------------------------------------------------


def _per_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_spec: P, mesh: Mesh, causal: bool) -> torch.Tensor:
    """Attention with seq whole: each rank's (batch, heads) blocks by the fused kernel, under :func:`shard_map`
    (plain tensors: no communication and no DTensor op strategy, as torchtitan computes between its column-
    and row-parallel linears), when the blocks are even; otherwise the reference on the DTensors."""
    dims = q_spec.dim_axes() + ((),) * (4 - len(q_spec))
    batch, heads = mesh.axis_size(dims[0]), mesh.axis_size(dims[2])
    if dims[3] or q.shape[0] % batch or q.shape[2] % heads:
        return reference_attention(q, k, v, causal=causal)
    if dims[2] and k.shape[2] % heads:  # kv heads cannot follow q heads: repeat them
        k, v = _repeat_kv(k, q.shape[2]), _repeat_kv(v, q.shape[2])
    spec = P(q_spec[0], None, q_spec[2])
    return shard_map(functools.partial(_local_attention, causal=causal), mesh, (spec, spec, spec), spec)(q, k, v)


def _axis_label(mesh: Mesh, axes: tuple[str, ...]) -> str:
    return "+".join(sorted(axes, key=mesh.axis_names.index))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True) -> torch.Tensor:
    """Multi-head attention (MHA/GQA/MQA) laid out by the active layout: ring attention under ``cp``.

    A fused kernel on every path (module docstring). With no active mesh it runs on the tensors; with
    rules that leave the query's ``seq`` whole, on each rank's heads. When the rules
    (``shardings.use(mesh, layout)``) map ``seq`` of ``("batch", "seq", "heads", "head_dim")`` to
    mesh axes, it runs ring attention over them (or all-gathers K/V when ``kv_seq`` is replicated:
    preset ``cp_allgather``); see the module docstring. Values and gradients equal the reference's.

    Args:
        q: ``(batch, seq, heads, head_dim)``.
        k: ``(batch, seq, kv_heads, head_dim)``; ``kv_heads`` divides ``heads``.
        v: like ``k``.
        causal: query ``s`` sees keys ``t <= s`` only. K/V longer than q (by ``p``) hold a prefix: the queries sit
            at positions ``p..p+seq-1`` (TeraPipe's chunks; not where the layout splits ``seq``).

    Returns:
        ``(batch, seq, heads, head_dim)``: a DTensor laid out like the query under a mesh.

    Raises:
        ShardingError: ``seq`` not a multiple of ``2·cp`` (causal) or ``cp``; a ``kv_seq`` rule on
            another axis than ``seq``'s.

    >>> with simulate(2), use(Mesh(cp=2), layouts.get("cp")):
    ...     out = attention(q, k, v)  # ring attention over "cp"; == reference_attention(q, k, v)
    """
    ctx = current()
    if ctx is None:
        if any(isinstance(t, DTensor) for t in (q, k, v)):  # laid out, but no rules to read: DTensor ops
            return reference_attention(q, k, v, causal=causal)
        return kernels.fused(q, k, v, causal=causal)
    mesh, rules = ctx.mesh, ctx.rules
    q_spec = logical_to_spec(Q_NAMES, rules, mesh)
    seq_axes = q_spec.dim_axes()[1]
    if not seq_axes:
        return _per_block(q, k, v, q_spec, mesh, causal)
    kv_rules = rules if rules.targets("kv_seq") else rules.replace(kv_seq=seq_axes)
    kv_seq_axes = logical_to_spec(KV_NAMES, kv_rules, mesh).dim_axes()[1]
    if kv_seq_axes not in ((), seq_axes):
        raise sharding_error(
            f"attention: the rules put the query's seq on {seq_axes} but kv_seq on {kv_seq_axes}",
            fix=f"map kv_seq to {seq_axes} (ring attention) or to None (all-gathered K/V), as presets cp and "
            "cp_allgather do",
            spec=q_spec,
            mesh=mesh,
        )
    n, seq = mesh.axis_size(seq_axes), q.shape[1]
    need = 2 * n if causal and kv_seq_axes else n
    if seq % need or k.shape[1] != seq:
        raise sharding_error(
            f"attention over seq split across {seq_axes} ({n} ranks) needs q and k/v of one length, a multiple of "
            f"{need}{' (2·cp load-balanced chunks)' if need != n else ''}; got q {tuple(q.shape)}, k {tuple(k.shape)}",
            fix=f"use a sequence length divisible by {need}, or a layout without cp",
            spec=q_spec,
            shape=q.shape,
            mesh=mesh,
        )
    heads_axes = q_spec.dim_axes()[2]
    if heads_axes and k.shape[2] % mesh.axis_size(heads_axes):  # kv heads cannot follow q heads: repeat them
        k, v = _repeat_kv(k, q.shape[2]), _repeat_kv(v, q.shape[2])
    kv_spec = P(q_spec[0], q_spec[1], q_spec[2])
    ring = _Ring(mesh, seq_axes[0] if len(seq_axes) == 1 else seq_axes, _axis_label(mesh, seq_axes), causal)
    local = _ring_local if kv_seq_axes else _allgather_local
    return shard_map(functools.partial(local, ring=ring), mesh, (q_spec, kv_spec, kv_spec), q_spec)(q, k, v)
