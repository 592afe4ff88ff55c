"""Mixed-precision policy: which dtype params are stored in, computed in, and reduced in.

``param_dtype`` is the storage (master) dtype the optimizer updates; ``compute_dtype`` is what
the forward/backward runs in; ``reduce_dtype`` is what gradients are communicated and
accumulated in. Only floating-point leaves are ever cast: integer/bool tensors (token ids,
step counters) and non-tensor leaves pass through untouched.

fp16's range is narrow (gradients underflow below 6e-8), so a policy computing in float16 scales
the loss by default (:class:`DynamicLossScale`, as DeepSpeed's ``loss_scale: 0`` and torch's
``GradScaler``): the loss is multiplied by the scale before backward, gradients are divided by it
before clipping, a step whose gradients hold an inf or NaN on any rank is skipped (params and
optimizer state unchanged) and halves the scale, and ``growth_interval`` clean steps in a row double it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from core import tree

__all__ = ["NAMED", "DynamicLossScale", "LossScaleState", "Policy", "name_of", "named"]

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


class LossScaleState(NamedTuple):
    """A dynamic loss scale's state, carried in the train step's optimizer state (a pytree of 0-d tensors).

    Attributes:
        scale: the factor the loss is multiplied by (float32).
        good_steps: clean steps since the scale last changed (int64).
        skipped: steps skipped so far because a gradient was not finite (int64).
    """

    scale: torch.Tensor
    good_steps: torch.Tensor
    skipped: torch.Tensor


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """Dynamic loss scaling: halve on a non-finite gradient (and skip the step), double after clean steps.

    Attributes:
        initial: the first scale (2**16, DeepSpeed's ``initial_scale_power: 16`` and torch's default).
        growth_interval: clean steps in a row before the scale doubles (2000, as torch's ``GradScaler``).
        factor: what the scale is multiplied by on growth and divided by on a skip.
        min_scale: the scale never goes below this.

    >>> s = DynamicLossScale(initial=8.0, growth_interval=2)
    >>> [float(st.scale) for st in _walk(s, [True, True, False, True])]
    [8.0, 8.0, 16.0, 8.0]
    """

    initial: float = 2.0**16
    growth_interval: int = 2000
    factor: float = 2.0
    min_scale: float = 1.0

    def __post_init__(self) -> None:
        if not (self.initial >= self.min_scale > 0 and self.factor > 1 and self.growth_interval >= 1):
            raise ValueError(
                f"DynamicLossScale{dataclasses.astuple(self)}: need initial >= min_scale > 0, factor > 1 and "
                "growth_interval >= 1. Fix: e.g. DynamicLossScale(initial=2.0**16, growth_interval=2000)."
            )

    def init(self) -> LossScaleState:
        """The state before the first step."""
        zero = torch.zeros((), dtype=torch.int64)
        return LossScaleState(torch.tensor(self.initial, dtype=torch.float32), zero, zero.clone())

    def adjust(self, state: LossScaleState, finite: bool) -> LossScaleState:
        """The state after a step whose gradients were (``finite``) or were not all finite."""
        if not finite:
            scale = torch.clamp(state.scale / self.factor, min=self.min_scale)
            return LossScaleState(scale, torch.zeros_like(state.good_steps), state.skipped + 1)
        good = state.good_steps + 1
        if int(good) >= self.growth_interval:
            return LossScaleState(state.scale * self.factor, torch.zeros_like(good), state.skipped)
        return LossScaleState(state.scale, good, state.skipped)


def _walk(scaler: DynamicLossScale, finite: list[bool]) -> list[LossScaleState]:
    state, out = scaler.init(), []
    for ok in finite:
        out.append(state)
        state = scaler.adjust(state, ok)
    return out


@dataclasses.dataclass(frozen=True)
class Policy:
    """Dtypes for the three roles of mixed-precision training.

    Attributes:
        param_dtype: dtype params (and the optimizer's view of them) are stored in.
        compute_dtype: dtype the model's forward and backward run in.
        reduce_dtype: dtype gradients are reduced and accumulated in.
        loss_scale: ``"auto"`` (a :class:`DynamicLossScale` when computing in float16, else none),
            ``None`` (never scale) or a :class:`DynamicLossScale`.

    >>> policy = Policy.from_string("params=float32,compute=bfloat16,reduce=float32")
    >>> policy.cast_to_compute({"w": torch.ones(2), "ids": torch.arange(2)})["w"].dtype
    torch.bfloat16
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    loss_scale: Any = "auto"

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self)[:3]:
            dtype = getattr(self, field.name)
            if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise TypeError(
                    f"Policy.{field.name} must be a floating torch.dtype, got {dtype!r}. "
                    f"Fix: pass e.g. {field.name}=torch.bfloat16."
                )
        if not (self.loss_scale in ("auto", None) or isinstance(self.loss_scale, DynamicLossScale)):
            raise TypeError(
                f"Policy.loss_scale must be 'auto', None or a DynamicLossScale, got {self.loss_scale!r}. "
                "Fix: pass loss_scale=DynamicLossScale(initial=2.0**16)."
            )

    @property
    def scaler(self) -> DynamicLossScale | None:
        """The loss scale the train step applies, if any (``"auto"``: dynamic for float16 compute)."""
        if self.loss_scale == "auto":
            return DynamicLossScale() if self.compute_dtype == torch.float16 else None
        return self.loss_scale

    @classmethod
    def fp32(cls) -> Policy:
        """Everything in float32 (the reference)."""
        return cls()

    @classmethod
    def bf16_mixed(cls) -> Policy:
        """float32 params and gradient reduction, bfloat16 compute (the usual large-model setting)."""
        return cls(compute_dtype=torch.bfloat16)

    @classmethod
    def fp16_mixed(cls) -> Policy:
        """float32 params and gradient reduction, float16 compute, dynamic loss scaling (DeepSpeed's fp16)."""
        return cls(compute_dtype=torch.float16)

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


# The named policies, one table for every place that names one (experiments' ``precision`` group, the planner's
# precisions, the benches): ``None`` is no policy, float32 throughout (the reference).
NAMED: dict[str, Callable[[], Policy] | None] = {"fp32": None, "bf16": Policy.bf16_mixed, "fp16": Policy.fp16_mixed}


def named(name: str) -> Policy | None:
    """The policy named ``name`` in :data:`NAMED` (``None`` for ``"fp32"``).

    Raises:
        ValueError: an unknown name.

    >>> named("bf16") == Policy.bf16_mixed()
    True
    """
    if name not in NAMED:
        raise ValueError(f"unknown precision {name!r}. Fix: use one of {sorted(NAMED)}.")
    make = NAMED[name]
    return make() if make is not None else None


def name_of(compute: str | torch.dtype) -> str:
    """The :data:`NAMED` policy that computes in ``compute`` (a dtype or its name); ``"fp32"`` for any other.

    >>> name_of("bfloat16"), name_of(torch.float32)
    ('bf16', 'fp32')
    """
    dtype = _DTYPES.get(compute.strip().lower()) if isinstance(compute, str) else compute
    return next((n for n, make in NAMED.items() if make is not None and make().compute_dtype == dtype), "fp32")


def _parse_dtype(name: str, text: str) -> torch.dtype:
    try:
        return _DTYPES[name.strip().lower()]
    except KeyError:
        raise ValueError(
            f"Policy string {text!r}: unknown dtype {name!r}. Fix: use one of {sorted(_DTYPES)}."
        ) from None
