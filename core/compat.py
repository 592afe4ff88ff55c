"""The private torch names ``core`` reaches, in one place (``shardings/runtime/compat.py``'s twin below shardings).

Each entry names the torch versions it was checked on and what happens without it: a fallback, or an error that
says which torch has it. ``core/tree.py`` wraps ``torch.utils._pytree`` itself (the pytree layer is that module).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["foreach", "fused_adamw", "has_fused_adamw"]

CHECKED = "2.11, 2.13"  # the torch versions every entry below was checked on


def foreach(name: str) -> Callable[..., Any] | None:
    """``torch._foreach_<name>`` (checked on torch 2.11 and 2.13), or ``None`` where this torch lacks it (the
    optimizers then take their per-leaf kernels: ``core.optim.foreach.PER_LEAF``)."""
    return getattr(torch, f"_foreach_{name}", None)


def has_fused_adamw() -> bool:
    """Whether this torch has the fused AdamW kernel ``torch._fused_adamw_`` (checked on torch 2.11 and 2.13)."""
    return hasattr(torch, "_fused_adamw_")


def fused_adamw(*args: Any, **kwargs: Any) -> None:
    """``torch._fused_adamw_`` (in place on lists of tensors; checked on torch 2.11 and 2.13).

    Raises:
        RuntimeError: this torch has no such kernel, naming the versions it was checked on.
    """
    if not has_fused_adamw():
        raise RuntimeError(f"torch {torch.__version__} has no torch._fused_adamw_ (checked on {CHECKED}). Fix: "
                           "install torch>=2.11, or run without donation (the unfused update)")
    torch._fused_adamw_(*args, **kwargs)
