"""Deferred init: learn each parameter's recipe once, then compute any rectangular block of it.

Inside ``with deferred():`` an init function runs without computing anything large: every
``core.random`` draw and every ``torch.zeros/ones/full`` returns a :class:`Deferred` that records
how to produce *any block* of the value. Elementwise arithmetic with Python numbers (``w * 0.02``,
``.to(dtype)``) stays deferred. A sharded init then asks each leaf only for the block a rank owns,
so no rank materializes a full parameter, and the block equals the same slice of the single-device
value bit for bit (the generators are counter-based; elementwise ops commute with slicing).

Anything else applied to a deferred value (a reshape, a concat, a matmul) cannot be evaluated
block-wise, and raises a ``TypeError`` that names the operation.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator, Sequence
from numbers import Number
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["Block", "Deferred", "active", "deferred", "full_block"]

Block = tuple[slice, ...]
_ACTIVE: list[bool] = []


def active() -> bool:
    """True inside :func:`deferred` (``core.random`` consults it to return :class:`Deferred` draws)."""
    return bool(_ACTIVE)


def full_block(shape: Sequence[int]) -> Block:
    """The block covering a whole tensor of ``shape``."""
    return tuple(slice(0, n) for n in shape)


def _block_shape(block: Block) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in block)


class Deferred:
    """A value known by its recipe: ``shape``, ``dtype`` and ``block(index) -> tensor``.

    >>> w = Deferred((4, 6), torch.float32, lambda b: torch.ones(*(s.stop - s.start for s in b))) * 3.0
    >>> w.block((slice(0, 2), slice(1, 4))).shape
    torch.Size([2, 3])
    """

    __slots__ = ("_fn", "dtype", "shape")

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, fn: Callable[[Block], torch.Tensor]):
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self._fn = fn

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def block(self, index: Block) -> torch.Tensor:
        """The values of ``self[index]`` (one ``slice(start, stop)`` per dim), computed directly."""
        index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, self.shape, strict=True))
        return self._fn(index)

    def materialize(self) -> torch.Tensor:
        """The whole value (what the single-device init would have returned)."""
        return self.block(full_block(self.shape))

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype | None = None) -> Deferred:
        inner = self._fn
        return Deferred(self.shape, dtype or self.dtype, lambda b: fn(inner(b)))

    def _scalar_op(self, op: Callable[[Any, Any], Any], other: Any, reflected: bool = False) -> Deferred:
        if not isinstance(other, Number):
            return NotImplemented
        return self._map((lambda t: op(other, t)) if reflected else (lambda t: op(t, other)))

    def __mul__(self, o: Any) -> Deferred:
        return self._scalar_op(operator.mul, o)

    def __rmul__(self, o: Any) -> Deferred:
        return self._scalar_op(operator.mul, o, reflected=True)

    def __add__(self, o: Any) -> Deferred:
        return self._scalar_op(operator.add, o)

    def __radd__(self, o: Any) -> Deferred:
        return self._scalar_op(operator.add, o, reflected=True)

    def __sub__(self, o: Any) -> Deferred:
        return self._scalar_op(operator.sub, o)

    def __rsub__(self, o: Any) -> Deferred:
        return self._scalar_op(operator.sub, o, reflected=True)

    def __truediv__(self, o: Any) -> Deferred:
        return self._scalar_op(operator.truediv, o)

    def __neg__(self) -> Deferred:
        return self._map(operator.neg)

    def to(self, dtype: torch.dtype) -> Deferred:
        """Cast lazily (only dtype casts are deferred; devices are chosen by the sharded init)."""
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"Deferred.to takes a dtype, got {dtype!r}")
        return self._map(lambda t: t.to(dtype), dtype)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes a Deferred lacks: tensor methods such as .reshape or .T.
        if name.startswith("__"):
            raise AttributeError(name)
        raise _not_blockwise(f"Tensor.{name}")

    def __getitem__(self, index: Any) -> Any:
        raise _not_blockwise("indexing")

    def __matmul__(self, other: Any) -> Any:
        raise _not_blockwise("matmul")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise _not_blockwise(getattr(func, "__name__", repr(func)))

    def __repr__(self) -> str:
        return f"Deferred(shape={tuple(self.shape)}, dtype={self.dtype})"


def _not_blockwise(name: str) -> TypeError:
    return TypeError(
        f"deferred init: {name}() was applied to a parameter that is still a recipe (a core.random draw or "
        "zeros/ones/full). A sharded init computes each parameter block by block, so a parameter must be one "
        "draw of its full shape, optionally scaled or shifted by Python numbers or cast with .to(dtype). "
        f"Fix: draw the parameter with its final shape instead of applying {name}() to it."
    )


def _shape_arg(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...]:
    size = kwargs.pop("size", None)
    if size is None:
        size = args[0] if len(args) == 1 and isinstance(args[0], Sequence) else args
    return tuple(int(n) for n in size)


def _constant(shape: tuple[int, ...], value: float, dtype: torch.dtype | None) -> Deferred:
    dtype = dtype or torch.get_default_dtype()
    return Deferred(shape, dtype, lambda b: torch.full(_block_shape(b), value, dtype=dtype))


class _DeferFactories(TorchFunctionMode):
    """Turns ``torch.zeros/ones/full/empty`` into :class:`Deferred` constants."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in (torch.zeros, torch.ones, torch.empty):
            dtype = kwargs.get("dtype")
            return _constant(_shape_arg(tuple(args), kwargs), 1.0 if func is torch.ones else 0.0, dtype)
        if func is torch.full:
            shape, value = args[0], args[1] if len(args) > 1 else kwargs["fill_value"]
            return _constant(tuple(shape), value, kwargs.get("dtype"))
        return func(*args, **kwargs)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Run an init function so that its parameters come back as :class:`Deferred` recipes."""
    _ACTIVE.append(True)
    try:
        with _DeferFactories():
            yield
    finally:
        _ACTIVE.pop()
