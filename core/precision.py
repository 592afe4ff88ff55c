"""Mixed-precision policy: which dtype params are stored in, computed in, and reduced in.

``param_dtype`` is the storage (master) dtype the optimizer updates; ``compute_dtype`` is what
the forward/backward runs in; ``reduce_dtype`` is what gradients are communicated and
accumulated in. Only floating-point leaves are ever cast: integer/bool tensors (token ids,
step counters) and non-tensor leaves pass through untouched.
"""

from __future__ import annotations

import dataclasses

import torch

from core import tree

__all__ = ["Policy"]

PyTree = tree.PyTree

# Accepted spellings, as in jmp's policy strings.
_DTYPES = {
    **dict.fromkeys(("float32", "f32", "fp32", "float"), torch.float32),
    **dict.fromkeys(("bfloat16", "bf16"), torch.bfloat16),
    **dict.fromkeys(("float16", "f16", "fp16", "half"), torch.float16),
    **dict.fromkeys(("float64", "f64", "fp64", "double"), torch.float64),
}
_ROLES = {
    **dict.fromkeys(("params", "param", "p"), "param_dtype"),
    **dict.fromkeys(("compute", "c"), "compute_dtype"),
    **dict.fromkeys(("reduce", "r"), "reduce_dtype"),
}


def _cast(x: PyTree, dtype: torch.dtype) -> PyTree:
    return tree.map(lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v, x)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class Policy:
    """Dtypes for the three roles of mixed-precision training.

    Attributes:
        param_dtype: dtype params (and the optimizer's view of them) are stored in.
        compute_dtype: dtype the model's forward and backward run in.
        reduce_dtype: dtype gradients are reduced and accumulated in.

    >>> policy = Policy.from_string("params=float32,compute=bfloat16,reduce=float32")
    >>> policy.cast_to_compute({"w": torch.ones(2), "ids": torch.arange(2)})["w"].dtype
    torch.bfloat16
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            dtype = getattr(self, field.name)
            if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise TypeError(
                    f"Policy.{field.name} must be a floating torch.dtype, got {dtype!r}. "
                    f"Fix: pass e.g. {field.name}=torch.bfloat16."
                )

    @classmethod
    def fp32(cls) -> Policy:
        """Everything in float32 (the reference)."""
        return cls()

    @classmethod
    def bf16_mixed(cls) -> Policy:
        """float32 params and gradient reduction, bfloat16 compute (the usual large-model setting)."""
        return cls(compute_dtype=torch.bfloat16)

    @classmethod
    def from_string(cls, text: str) -> Policy:
        """Parse ``"params=float32,compute=bfloat16,reduce=float32"``; a lone dtype sets all three.

        Roles may be abbreviated (``p``, ``c``, ``r``) and dtypes written ``f32``/``fp32``/``bf16``/
        ``f16``/...; an omitted role keeps its float32 default. ``str(policy)`` round-trips.

        Raises:
            ValueError: an unknown role or dtype, or a malformed entry.

        >>> Policy.from_string("c=bf16") == Policy.bf16_mixed()
        True
        """
        text = text.strip()
        if "=" not in text:
            dtype = _parse_dtype(text, text)
            return cls(dtype, dtype, dtype)
        kwargs = {}
        for entry in text.split(","):
            role, sep, name = (s.strip() for s in entry.partition("="))
            if not sep or role.lower() not in _ROLES:
                raise ValueError(
                    f"Policy string {text!r}: cannot read entry {entry!r}. "
                    f"Fix: write role=dtype pairs, roles in {sorted(set(_ROLES))}, e.g. 'params=float32,compute=bf16'."
                )
            kwargs[_ROLES[role.lower()]] = _parse_dtype(name, text)
        return cls(**kwargs)

    def __str__(self) -> str:
        return (
            f"params={_dtype_name(self.param_dtype)},compute={_dtype_name(self.compute_dtype)},"
            f"reduce={_dtype_name(self.reduce_dtype)}"
        )

    def cast_to_param(self, x: PyTree) -> PyTree:
        """Cast the floating leaves of ``x`` to ``param_dtype``."""
        return _cast(x, self.param_dtype)

    def cast_to_compute(self, x: PyTree) -> PyTree:
        """Cast the floating leaves of ``x`` to ``compute_dtype``."""
        return _cast(x, self.compute_dtype)

    def cast_to_reduce(self, x: PyTree) -> PyTree:
        """Cast the floating leaves of ``x`` to ``reduce_dtype``."""
        return _cast(x, self.reduce_dtype)


def _parse_dtype(name: str, text: str) -> torch.dtype:
    try:
        return _DTYPES[name.strip().lower()]
    except KeyError:
        raise ValueError(
            f"Policy string {text!r}: unknown dtype {name!r}. Fix: use one of {sorted(_DTYPES)}."
        ) from None
