"""Counter-based random numbers with explicit keys: every value is a pure function of (key, index).

The algorithm is part of the contract, because sharded init relies on it bit for bit:

* **Keys** are ``int64`` tensors of shape ``(2,)`` holding two 32-bit words ``(k0, k1)``, each in
  ``[0, 2**32)``. ``key(seed)`` is ``(seed >> 32, seed & 0xFFFFFFFF)`` of the seed taken mod ``2**64``.
* **Block function**: Threefry-2x32 with 20 rounds (Salmon et al., "Parallel random numbers: as easy as
  1, 2, 3", SC'11; the generator behind ``jax.random``) maps a key and a counter ``(c0, c1)`` to two
  32-bit words. It runs as vectorized int64 torch ops in which no value ever reaches ``2**63`` and only
  non-negative values are shifted right, so it is exact on every backend.
* **Counters**: the element at row-major index ``i`` of ``shape`` reads the block at counter
  ``i // m`` (``c0`` = low word, ``c1`` = high word). ``m = 2`` for 32-bit samples (element ``i`` takes
  word ``i % 2``) and for normals (one Box–Muller pair per block); ``m = 1`` for float64 uniforms, which
  use all 64 bits. Sample counters have ``c1 < 2**31``; :func:`split` uses ``c1 = 0xFFFFFFFF`` and
  :func:`fold_in` ``c1 = 0xFFFFFFFE``, so derived keys never coincide with sample blocks.
* **Floats** are computed in float32 (float64 when asked) and rounded to ``dtype``:
  uniform ``[0, 1)`` is ``(w >> 8) * 2**-24`` (float32) or ``53 bits of (w0, w1) * 2**-53`` (float64);
  normal is Box–Muller, ``sqrt(-2 log u1) * (cos, sin)(2π u2)`` for elements ``(2j, 2j + 1)``, with
  ``u1 = (w0 + 1) * 2**-b`` in ``(0, 1]`` and ``u2 = w1 * 2**-b`` built from the top ``b`` bits of the
  words (``b = 24`` in float32, 32 in float64: tails reach 5.8σ and 6.7σ); truncated normal is the
  inverse CDF ``sqrt(2) * erfinv(u)`` of ``u`` uniform in ``[erf(lower/√2), erf(upper/√2))``.

Because a value depends only on the global index, ``normal(k, shape, block=b)`` equals
``normal(k, shape)[b]`` exactly while computing only the block: each rank draws just the shard it owns.
Values are identical across devices at the bit level for :func:`bits`/:func:`randint`; float samplers
may differ in the last ulp between CPU and GPU math libraries. Two draws from one key are correlated
(``uniform`` and ``normal`` read the same words): :func:`split` the key first.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from core import deferred
from core.counters import _MASK, Block, Shape, _check_key, _error, _index, _ranges, _stream, _threefry, _words

__all__ = ["bits", "fold_in", "key", "normal", "randint", "split", "truncated_normal", "uniform"]

_SPLIT_TAG = 0xFFFF_FFFF
_FOLD_TAG = 0xFFFF_FFFE
_CHUNK = 1 << 16  # counters per pass: Threefry's ~110 elementwise passes then stay in cache
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def key(seed: int) -> Tensor:
    """A PRNG key from an integer seed.

    Args:
        seed: any int in ``[-2**63, 2**64)``; it is taken mod ``2**64`` and split into two 32-bit words.

    Returns:
        An int64 tensor ``[seed >> 32, seed & 0xFFFFFFFF]`` of shape ``(2,)``.

    Raises:
        TypeError: ``seed`` is not an int. ValueError: it is out of range.

    >>> key(2**32 + 7)
    tensor([1, 7])
    """
    seed = _index(seed, "seed")
    if not -(2**63) <= seed < 2**64:
        raise _error(f"seed must lie in [-2**63, 2**64), got {seed}", "pass a 64-bit seed, e.g. seed % 2**64")
    seed %= 2**64
    return torch.tensor([seed >> 32, seed & _MASK], dtype=torch.int64)


def split(key: Tensor, n: int = 2) -> Tensor:
    """``n`` new keys derived from ``key``: row ``i`` is ``threefry(key, (i, 0xFFFFFFFF))``.

    Args:
        key: a key of shape ``(2,)``.
        n: how many keys, ``0 <= n <= 2**32``.

    Returns:
        An int64 tensor of shape ``(n, 2)`` whose rows are keys, so ``k1, k2 = split(key)`` works.

    Raises:
        TypeError/ValueError: a malformed key, or ``n`` not an int in range.

    >>> k_init, k_dropout = split(key(0))
    """
    key = _check_key(key)
    n = _index(n, "n")
    if not 0 <= n <= 2**32:
        raise _error(f"split needs 0 <= n <= 2**32 keys, got n={n}", "ask for a non-negative number of keys")
    counter = torch.arange(n, dtype=torch.int64, device=key.device)
    y0, y1 = _threefry(key[0], key[1], counter, torch.full_like(counter, _SPLIT_TAG))
    return torch.stack((y0, y1), dim=-1)  # (n, 2)


def fold_in(key: Tensor, data: int | Tensor) -> Tensor:
    """A new key mixing the 32-bit integer ``data`` into ``key``: ``threefry(key, (data, 0xFFFFFFFE))``.

    Args:
        key: a key of shape ``(2,)``.
        data: an int in ``[0, 2**32)`` or a 0-d integer tensor (e.g. a step count or a rank; under
            simulated ranks a per-rank tensor gives each rank its own key).

    Returns:
        An int64 key of shape ``(2,)``.

    Raises:
        TypeError/ValueError: a malformed key, or ``data`` not an integer in range.

    >>> layer_keys = [fold_in(key(0), i) for i in range(4)]
    """
    key = _check_key(key)
    if isinstance(data, Tensor) and data.dim() == 0 and not (data.is_floating_point() or data.is_complex()):
        word = data.to(device=key.device, dtype=torch.int64).reshape(1)
        if type(word) is Tensor and not 0 <= int(word) <= _MASK:
            raise _error(f"fold_in data must lie in [0, 2**32), got {int(word)}", "reduce it, e.g. data % 2**32")
    else:
        value = _index(data, "data")
        if not 0 <= value <= _MASK:
            raise _error(f"fold_in data must lie in [0, 2**32), got {value}", "reduce it, e.g. data % 2**32")
        word = torch.tensor([value], dtype=torch.int64, device=key.device)
    y0, y1 = _threefry(key[0], key[1], word, torch.full_like(word, _FOLD_TAG))
    return torch.cat((y0, y1))


def _unit53(x0: Tensor, x1: Tensor) -> Tensor:
    return (((x0 << 21) | (x1 >> 11)).to(torch.float64) * 2.0**-53)[..., None]


def _box_muller(x0: Tensor, x1: Tensor, dtype: torch.dtype) -> Tensor:
    b = 24 if dtype == torch.float32 else 32  # bits per uniform: what the float type holds exactly
    u1 = ((x0 >> (32 - b)) + 1).to(dtype) * 2.0**-b  # (0, 1], so the log is finite
    theta = (x1 >> (32 - b)).to(dtype) * (2 * math.pi * 2.0**-b)  # [0, 2π)
    r = torch.log(u1).mul_(-2).sqrt_()
    return torch.stack((r * torch.cos(theta), r * torch.sin(theta)), dim=-1)


def _compute_dtype(dtype: torch.dtype, sampler: str) -> torch.dtype:
    if dtype not in _FLOATS:
        raise _error(
            f"{sampler} needs a floating dtype, got {dtype}", "use float16, bfloat16, float32 or float64", TypeError
        )
    return torch.float64 if dtype == torch.float64 else torch.float32


def _interval(lo: float, hi: float, names: str) -> tuple[float, float]:
    lo, hi = float(lo), float(hi)
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise _error(
            f"{names} must be finite with the first below the second, got ({lo}, {hi})", "pass e.g. (0.0, 1.0)"
        )
    return lo, hi


def _nearest_inside(v: float, toward: float, dtype: torch.dtype, device: torch.device, strict: bool) -> Tensor:
    """The ``dtype`` value closest to ``v`` that is not past it, seen from ``toward`` (nor equal when strict)."""
    t = torch.tensor(v, dtype=dtype, device=device)
    crossed = float(t) > v if toward < v else float(t) < v
    if crossed or (strict and float(t) == v):
        t = torch.nextafter(t, torch.tensor(toward, dtype=dtype, device=device))
    return t


def _unit(k: Tensor, shape: Shape, block: Block | None, dtype: torch.dtype) -> Tensor:
    """Uniform ``[0, 1)`` in float32 (24 bits of one word) or float64 (53 bits of both words)."""
    if dtype == torch.float64:
        return _stream(k, shape, block, 1, _unit53, torch.float64, chunk=_CHUNK)
    return (_stream(k, shape, block, 2, _words, torch.int64, chunk=_CHUNK) >> 8).to(torch.float32) * 2.0**-24


def _draw(
    k: Tensor, shape: Shape, block: Block | None, dtype: torch.dtype, compute: Callable[[Block | None], Tensor]
) -> Tensor:
    """``compute(block)``; inside ``core.deferred.deferred()`` a full draw becomes a recipe for any block."""
    if block is None and deferred.active():
        _check_key(k)
        return deferred.Deferred(_ranges(shape, None)[0], dtype, compute)
    return compute(block)


def bits(key: Tensor, shape: Shape, *, block: Block | None = None) -> Tensor:
    """Uniform random 32-bit words, as int64 in ``[0, 2**32)``; element ``i`` is word ``i % 2`` of block ``i // 2``.

    Args:
        key: a key of shape ``(2,)``.
        shape: the full (global) shape.
        block: optional ``slice(start, stop)`` or ``(start, stop)`` per dim; returns ``bits(key, shape)[block]``
            without computing the rest.

    Returns:
        An int64 tensor of the block's shape (inside ``core.deferred.deferred()`` with no block: a
        ``Deferred`` recipe; the same holds for every sampler here).

    Raises:
        TypeError/ValueError: a malformed key, shape or block.

    >>> bits(key(0), (2, 3)).shape
    torch.Size([2, 3])
    """
    return _draw(key, shape, block, torch.int64, lambda b: _stream(key, shape, b, 2, _words, torch.int64, chunk=_CHUNK))


def uniform(
    key: Tensor,
    shape: Shape,
    dtype: torch.dtype = torch.float32,
    minval: float = 0.0,
    maxval: float = 1.0,
    *,
    block: Block | None = None,
) -> Tensor:
    """Uniform samples in ``[minval, maxval)``: ``minval + u * (maxval - minval)``, clipped after rounding to ``dtype``.

    Args:
        key: a key of shape ``(2,)``.
        shape: the full (global) shape.
        dtype: float16, bfloat16, float32 or float64.
        minval, maxval: finite bounds, ``minval < maxval``.
        block: optional ``slice(start, stop)`` or ``(start, stop)`` per dim; the result equals
            ``uniform(key, shape, ...)[block]`` bit for bit, computing only the block.

    Returns:
        A tensor of the block's shape and ``dtype``.

    Raises:
        TypeError/ValueError: a malformed key, shape, block, dtype or interval.

    >>> x = uniform(key(0), (4, 8), minval=-1.0, maxval=1.0, block=(slice(0, 2), slice(0, 8)))
    """
    gen = _compute_dtype(dtype, "uniform")
    minval, maxval = _interval(minval, maxval, "uniform (minval, maxval)")

    def compute(b: Block | None) -> Tensor:
        x = (_unit(key, shape, b, gen) * (maxval - minval) + minval).to(dtype)
        lo = _nearest_inside(minval, maxval, dtype, x.device, strict=False)
        return x.clamp_(lo, _nearest_inside(maxval, minval, dtype, x.device, strict=True))

    return _draw(key, shape, block, dtype, compute)


def normal(key: Tensor, shape: Shape, dtype: torch.dtype = torch.float32, *, block: Block | None = None) -> Tensor:
    """Standard normal samples (Box–Muller: elements ``2j`` and ``2j + 1`` are the cos/sin pair of block ``j``).

    Args:
        key: a key of shape ``(2,)``.
        shape: the full (global) shape.
        dtype: float16, bfloat16, float32 or float64.
        block: optional ``slice(start, stop)`` or ``(start, stop)`` per dim; the result equals
            ``normal(key, shape, dtype)[block]`` bit for bit, computing only the block.

    Returns:
        A tensor of the block's shape and ``dtype``.

    Raises:
        TypeError/ValueError: a malformed key, shape, block or dtype.

    >>> w = normal(key(0), (1024, 4096), block=(slice(0, 512), slice(None)))  # rank 0 of 2, sharded on dim 0
    """
    gen = _compute_dtype(dtype, "normal")
    box_muller = functools.partial(_box_muller, dtype=gen)
    return _draw(key, shape, block, dtype, lambda b: _stream(key, shape, b, 2, box_muller, gen, chunk=_CHUNK).to(dtype))


def truncated_normal(
    key: Tensor,
    shape: Shape,
    dtype: torch.dtype = torch.float32,
    lower: float = -2.0,
    upper: float = 2.0,
    *,
    block: Block | None = None,
) -> Tensor:
    """Standard normal samples conditioned on ``[lower, upper]``, by inverse CDF: ``√2 · erfinv(u)``.

    ``u`` is uniform in ``[erf(lower/√2), erf(upper/√2))``: exact in distribution and one uniform per
    sample, so blocks stay addressable. Accurate for moderate bounds: far in the tails the float32
    grid of ``u`` near ±1 is coarse.

    Args:
        key: a key of shape ``(2,)``.
        shape: the full (global) shape.
        dtype: float16, bfloat16, float32 or float64.
        lower, upper: finite bounds in standard deviations, ``lower < upper``.
        block: optional ``slice(start, stop)`` or ``(start, stop)`` per dim; the result equals
            ``truncated_normal(key, shape, ...)[block]`` bit for bit, computing only the block.

    Returns:
        A tensor of the block's shape and ``dtype``, within ``[lower, upper]``.

    Raises:
        TypeError/ValueError: a malformed key, shape, block, dtype or interval.

    >>> w = 0.02 * truncated_normal(key(0), (768, 3072))
    """
    gen = _compute_dtype(dtype, "truncated_normal")
    lower, upper = _interval(lower, upper, "truncated_normal (lower, upper)")
    a, b = math.erf(lower / math.sqrt(2)), math.erf(upper / math.sqrt(2))

    def compute(blk: Block | None) -> Tensor:
        z = (torch.erfinv(_unit(key, shape, blk, gen) * (b - a) + a) * math.sqrt(2)).to(dtype)
        lo = _nearest_inside(lower, upper, dtype, z.device, strict=False)
        return z.clamp_(lo, _nearest_inside(upper, lower, dtype, z.device, strict=False))

    return _draw(key, shape, block, dtype, compute)


def randint(
    key: Tensor,
    shape: Shape,
    minval: int,
    maxval: int,
    dtype: torch.dtype = torch.int64,
    *,
    block: Block | None = None,
) -> Tensor:
    """Uniform integers in ``[minval, maxval)``: ``minval + (w * span) >> 32`` of one 32-bit word ``w``.

    The multiply-shift map has a relative bias below ``span / 2**32`` (under 5e-7 for a 2048-entry vocab).

    Args:
        key: a key of shape ``(2,)``.
        shape: the full (global) shape.
        minval, maxval: ints with ``1 <= maxval - minval <= 2**31``, both representable in ``dtype``.
        dtype: an integer dtype.
        block: optional ``slice(start, stop)`` or ``(start, stop)`` per dim, as in :func:`bits`.

    Returns:
        A tensor of the block's shape and ``dtype``.

    Raises:
        TypeError/ValueError: a malformed key, shape, block, dtype or range.

    >>> tokens = randint(key(0), (8, 64), 0, 256)
    """
    if dtype == torch.bool or dtype.is_floating_point or dtype.is_complex:
        raise _error(f"randint needs an integer dtype, got {dtype}", "use e.g. torch.int64", TypeError)
    minval, maxval = _index(minval, "minval"), _index(maxval, "maxval")
    info = torch.iinfo(dtype)
    if not (1 <= maxval - minval <= 2**31 and info.min <= minval and maxval - 1 <= info.max):
        raise _error(
            f"randint needs 1 <= maxval - minval <= 2**31 within {dtype}, got [{minval}, {maxval})",
            "narrow the range or widen the dtype",
        )

    def compute(b: Block | None) -> Tensor:
        words = _stream(key, shape, b, 2, _words, torch.int64, chunk=_CHUNK)
        return ((words * (maxval - minval) >> 32) + minval).to(dtype)

    return _draw(key, shape, block, dtype, compute)
