"""Function transforms on pytrees: ``grad``, ``value_and_grad``, ``vmap``, ``jit``, ``remat``.

``grad``/``value_and_grad`` run on torch's autograd engine rather than ``torch.func.grad``:
``torch.func.grad`` refuses saved-tensor hooks, which non-reentrant activation checkpointing
(:func:`remat`) and backward-time communication hooks both rely on. The API is still pure:
inputs are never mutated, and the differentiated leaves are fresh detached aliases.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.checkpoint

from core import tree

__all__ = ["grad", "jit", "remat", "value_and_grad", "vmap"]


def _as_tuple(argnums: int | Sequence[int]) -> tuple[int, ...]:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def _watch(x: Any) -> Any:
    if not (isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())):
        return x
    # Inside an outer grad the input already requires grad: alias it so the outer graph stays connected.
    return x.view_as(x) if x.requires_grad else x.detach().requires_grad_(True)


def _requires_grad(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad


def value_and_grad(
    fn: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """Return ``f(*args) -> (value, grads)`` (``((value, aux), grads)`` with ``has_aux``), as in JAX.

    Args:
        fn: a function returning a scalar tensor (or ``(scalar, aux)`` with ``has_aux``).
        argnums: which positional argument(s) to differentiate; a tuple gives a tuple of grads.
        has_aux: whether ``fn`` returns ``(value, aux)``.

    Returns:
        A function with ``fn``'s signature. Grads have the structure of the differentiated
        argument(s); a leaf that does not influence the value gets zeros.

    >>> f = value_and_grad(lambda p: (p["w"] ** 2).sum())
    >>> value, g = f({"w": torch.tensor([1.0, 2.0])})
    >>> g["w"].tolist()
    [2.0, 4.0]
    """
    nums = _as_tuple(argnums)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        args = list(args)
        # Higher-order use (a grad inside a grad) keeps the graph so the outer grad can see it.
        create_graph = torch.is_grad_enabled() and any(map(_requires_grad, tree.leaves((args, kwargs))))
        for i in nums:
            if i >= len(args):
                raise TypeError(f"value_and_grad: argnums={argnums} but only {len(args)} positional args given")
            args[i] = tree.map(_watch, args[i])
        with torch.enable_grad():
            out = fn(*args, **kwargs)
            value, aux = out if has_aux else (out, None)
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise TypeError(
                    f"value_and_grad: {getattr(fn, '__name__', fn)} must return a scalar tensor"
                    f"{' as the first element of (value, aux)' if has_aux else ''}, got {type(value).__name__}"
                    f"{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}."
                )
            flat = [tree.leaves(args[i]) for i in nums]
            watched = [t for leaves in flat for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
            grads = torch.autograd.grad(value, watched, allow_unused=True, create_graph=create_graph)
        by_id = {id(t): g if g is not None else torch.zeros_like(t) for t, g in zip(watched, grads)}
        out_grads = tuple(
            tree.map(lambda t: by_id.get(id(t)) if isinstance(t, torch.Tensor) else None, args[i]) for i in nums
        )
        if not create_graph:
            value = value.detach()
        g = out_grads[0] if isinstance(argnums, int) else out_grads
        return ((value, aux), g) if has_aux else (value, g)

    return wrapped


def grad(fn: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable[..., Any]:
    """Return ``f(*args) -> grads`` (``(grads, aux)`` with ``has_aux``). See :func:`value_and_grad`."""
    vg = value_and_grad(fn, argnums=argnums, has_aux=has_aux)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        value, g = vg(*args, **kwargs)
        return (g, value[1]) if has_aux else g

    return wrapped


def vmap(fn: Callable[..., Any], in_axes: Any = 0, out_axes: Any = 0, **kwargs: Any) -> Callable[..., Any]:
    """Vectorize ``fn`` over a leading (or chosen) axis of pytree arguments; ``torch.func.vmap``."""
    return torch.func.vmap(fn, in_dims=in_axes, out_dims=out_axes, **kwargs)


def jit(fn: Callable[..., Any] | None = None, **compile_kwargs: Any) -> Callable[..., Any]:
    """Compile ``fn`` with ``torch.compile``; usable as ``@jit`` or ``@jit(mode=...)``.

    Defaults: ``dynamic=False`` (shapes are static in training steps, as under ``jax.jit``).
    Other keyword arguments go to ``torch.compile`` unchanged.
    """
    if fn is None:
        return functools.partial(jit, **compile_kwargs)
    compile_kwargs.setdefault("dynamic", False)
    return torch.compile(fn, **compile_kwargs)


def remat(fn: Callable[..., Any] | None = None, *,
          policy: Callable[..., Any] | str | None = None) -> Callable[..., Any]:
    """Activation checkpointing: keep only ``fn``'s inputs, recompute its insides in backward.

    Usable as ``@remat`` or ``remat(block)(params, x)``. ``policy`` is an optional
    ``torch.utils.checkpoint`` context factory for selective checkpointing, or ``"offload"``: recompute
    nothing, keep everything ``fn`` saves for backward in host memory instead (``core.offload.saved_on_host``:
    copied to the host in forward, back in backward; counted by ``shardings.comms()`` as ``d2h``/``h2d``).
    """
    if fn is None:
        return functools.partial(remat, policy=policy)
    if policy == "offload":
        from core.offload import saved_on_host

        @functools.wraps(fn)
        def offloaded(*args: Any, **kwargs: Any) -> Any:
            with saved_on_host():
                return fn(*args, **kwargs)

        return offloaded
    if isinstance(policy, str):
        raise ValueError(f"core.remat: unknown policy {policy!r}. Fix: pass 'offload' or a checkpoint context factory.")
    extra = {"context_fn": policy} if policy is not None else {}

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # a traced graph has its context baked in
            return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **extra, **kwargs)
        # backward recomputes ``fn`` wherever it runs (a pipeline rank's backward runs outside the stage's call):
        # it must see the context variables forward saw (``shardings.use``'s mesh and rules), so both run in
        # one snapshot of them
        ambient = contextvars.copy_context()
        return torch.utils.checkpoint.checkpoint(functools.partial(ambient.run, fn), *args, use_reentrant=False,
                                                 **extra, **kwargs)

    return wrapped
