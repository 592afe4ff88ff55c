"""Counter-based bit streams: which Threefry counter feeds which element of any block of a shape.

The machinery behind :mod:`core.random`, whose module docstring states the contract:

* :func:`_threefry` is the Threefry-2x32-20 block function, exact in int64 on every backend.
* :func:`_stream` lays a shape out in row-major order and gives element ``i`` the output of the block
  at counter ``i // per`` (``c0`` = low word, ``c1`` = high word), computing only the requested block.
* :func:`_ranges`, :func:`_check_key` and :func:`_index` validate the shapes, blocks, keys and ints
  that address a stream, with errors that name the fix.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence

import torch
from einops import rearrange
from torch import Tensor

Shape = int | Sequence[int]
Block = Sequence[slice | tuple[int, int]]

_MASK = 0xFFFF_FFFF
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD1_1BDA


def _error(problem: str, fix: str, cls: type[Exception] = ValueError) -> Exception:
    return cls(f"{problem}. Fix: {fix}.")


def _threefry(k0: Tensor, k1: Tensor, x0: Tensor, x1: Tensor) -> tuple[Tensor, Tensor]:
    """Threefry-2x32-20 of counter words ``(x0, x1)`` under key words ``(k0, k1)``; all int64 in ``[0, 2**32)``."""
    ks = (k0, k1, k0 ^ k1 ^ _PARITY)
    # Only x1 must stay below 2**32, because it is rotated (shifted right). x0 is only added and xored,
    # which never move high bits down, so it may carry past bit 31 (it stays below 2**37) until the end.
    x0 = x0 + ks[0]
    x1 = (x1 + ks[1]) & _MASK
    low = torch.empty_like(x1)
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0.add_(x1)
            torch.bitwise_right_shift(x1, 32 - r, out=low)
            torch.add(low, x1, alpha=1 << r, out=x1)  # rotl(x1, r), plus bits >= 32 that the mask drops
            x1.bitwise_xor_(x0).bitwise_and_(_MASK)
        x0.add_(ks[(i + 1) % 3])
        x1.add_(ks[(i + 2) % 3] + (i + 1)).bitwise_and_(_MASK)
    return x0 & _MASK, x1


def _check_key(k: object, name: str = "key") -> Tensor:
    if not isinstance(k, Tensor) or k.dtype != torch.int64:
        got = f"a {k.dtype} tensor" if isinstance(k, Tensor) else type(k).__name__
        raise _error(
            f"{name} must be an int64 tensor of shape (2,), got {got}", "make one with core.random.key(seed)", TypeError
        )
    if tuple(k.shape) != (2,):
        fix = "pick one row, e.g. split(key, n)[i]" if k.dim() == 2 else "make one with core.random.key(seed)"
        raise _error(f"{name} must have shape (2,) (two 32-bit words), got shape {tuple(k.shape)}", fix)
    # Values can only be read from plain tensors (a simulated-rank LocalTensor may differ per rank).
    if type(k) is Tensor and bool(((k < 0) | (k > _MASK)).any()):
        raise _error(f"{name} words must lie in [0, 2**32), got {k.tolist()}", "make keys with key/split/fold_in")
    return k


def _index(value: object, name: str) -> int:
    if isinstance(value, bool) or (isinstance(value, Tensor) and value.is_floating_point()):
        raise _error(f"{name} must be an int, got {value!r}", f"pass an int {name}", TypeError)
    try:
        return operator.index(value)
    except TypeError:
        raise _error(
            f"{name} must be an int, got {type(value).__name__} {value!r}", f"pass an int {name}", TypeError
        ) from None


def _ranges(shape: Shape, block: Block | None) -> tuple[list[int], list[tuple[int, int]]]:
    """Validate ``shape`` and ``block``; return the sizes and the block's ``(start, stop)`` in each dim."""
    dims = [_index(shape, "shape")] if not isinstance(shape, Sequence) else [_index(s, "shape entry") for s in shape]
    if any(s < 0 for s in dims) or math.prod(dims) >= 2**63:
        raise _error(
            f"shape must have non-negative sizes and fewer than 2**63 elements, got {tuple(dims)}", "fix the shape"
        )
    if block is None:
        return dims, [(0, s) for s in dims]
    if not isinstance(block, Sequence) or len(block) != len(dims):
        raise _error(
            f"block must give one slice(start, stop) or (start, stop) per dim of shape {tuple(dims)}, got {block!r}",
            f"pass {len(dims)} entries",
        )
    ranges = []
    for d, (b, size) in enumerate(zip(block, dims)):
        if isinstance(b, slice) and b.step in (None, 1):
            start, stop = (0 if b.start is None else b.start), (size if b.stop is None else b.stop)
        elif isinstance(b, Sequence) and len(b) == 2:
            start, stop = b
        else:
            raise _error(f"block[{d}] must be slice(start, stop) or (start, stop), got {b!r}", "use a step-1 range")
        start, stop = _index(start, f"block[{d}] start"), _index(stop, f"block[{d}] stop")
        if not 0 <= start <= stop <= size:
            raise _error(
                f"block[{d}] = {b!r} is out of range for dim {d} of size {size} (shape {tuple(dims)})",
                f"use 0 <= start <= stop <= {size}",
            )
        ranges.append((start, stop))
    return dims, ranges


def _stream(
    k: Tensor,
    shape: Shape,
    block: Block | None,
    per: int,
    fn: Callable[[Tensor, Tensor], Tensor],
    dtype: torch.dtype,
    *,
    chunk: int,
) -> Tensor:
    """Values of ``block`` of ``shape``: element ``i`` is ``fn(*threefry(k, i // per))[..., i % per]``.

    Threefry runs on ``chunk`` counters at a time; the values do not depend on it.
    """
    k = _check_key(k)
    dims, ranges = _ranges(shape, block)
    out_shape = tuple(stop - start for start, stop in ranges)
    if math.prod(out_shape) == 0:
        return k.new_empty(out_shape, dtype=dtype)  # not torch.empty, which core.deferred intercepts
    *lead, (start, stop) = ranges or [(0, 1)]
    strides = [math.prod(dims[d + 1 :]) for d in range(len(dims))]
    # first: the global index of each row's first element, rows (all but the last dim) in row-major order.
    first = torch.tensor([start], dtype=torch.int64, device=k.device)
    for (a, b), stride in zip(reversed(lead), reversed(strides[:-1]), strict=True):
        first = (torch.arange(a, b, device=k.device)[:, None] * stride + first).reshape(-1)
    n = stop - start
    width = n if per == 1 else n // 2 + 1  # counters per row, enough whether the row starts at an even or odd index
    counters = (first[:, None] // per + torch.arange(width, device=k.device)).reshape(-1)  # (rows * width,)
    chunks = [fn(*_threefry(k[0], k[1], c & _MASK, c >> 32)) for c in counters.split(chunk)]
    values = rearrange(torch.cat(chunks), "(rows width) per -> rows (width per)", width=width)
    if per == 2:  # a row starting at an odd index skips the first half of its first block
        values = torch.where((first % 2 == 1)[:, None], values[:, 1 : n + 1], values[:, :n])
    return values.reshape(out_shape)


def _words(x0: Tensor, x1: Tensor) -> Tensor:
    return torch.stack((x0, x1), dim=-1)
