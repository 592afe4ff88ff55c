"""The active mesh and activation rules, and ``constrain``: ``with_sharding_constraint`` for activations.

Model code calls ``constrain(x, ("batch", "seq", "embed"))`` at the points where an activation's
layout matters. Outside :func:`use` that is a no-op returning ``x`` itself, so the same function
is the single-device reference; inside ``use(mesh, rules)`` it redistributes ``x`` to the spec
the rules give, and the collectives (all-gather, reduce-scatter, all-reduce) follow from the
placements before and after, in forward and backward.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch

from shardings.spec import layouts
from shardings.spec.errors import sharding_error
from shardings.spec.lower import constrain_to, on_mesh, to_placements
from shardings.spec.mesh import Mesh, P
from shardings.spec.placeholder import resolve
from shardings.spec.rules import Rules, logical_to_spec

__all__ = ["Context", "constrain", "current", "use"]


class Context(NamedTuple):
    """What :func:`use` activated: the mesh and the rules that resolve activation names."""

    mesh: Mesh
    rules: Rules


# A ContextVar, not a global: each thread (and asyncio task) sees only the contexts it entered.
_CURRENT: contextvars.ContextVar[Context | None] = contextvars.ContextVar("shardings_context", default=None)
# The same value as a plain global, for code torch.compile traces: dynamo cannot read a ContextVar (a graph
# break per read), but reads a global and guards on it, so a compiled function recompiles if the context changes.
# Only use() writes it; current() reads it only while tracing.
_TRACED: Context | None = None


def _activation_rules(rules_or_layout: Any) -> Rules:
    if rules_or_layout is None:
        return Rules()
    if isinstance(rules_or_layout, Rules):
        return rules_or_layout
    if isinstance(rules_or_layout, str):  # a preset or composition, spelled as train_step takes it
        return layouts.get(rules_or_layout).activation_rules
    rules = getattr(rules_or_layout, "activation_rules", None)
    if isinstance(rules, Rules):
        return rules
    raise sharding_error(
        f"expected Rules or a layout with an `activation_rules` attribute, got {type(rules_or_layout).__name__}",
        fix="pass shardings.Rules(...), a shardings.spec.layouts.Layout or a layout string such as 'zero3+tp'",
        cls=TypeError,
    )


@contextlib.contextmanager
def use(mesh: Mesh, rules_or_layout: Rules | str | Any = None) -> Iterator[Context]:
    """Activate ``mesh`` and activation rules for :func:`constrain` inside the body.

    Nestable: an inner ``use`` shadows the outer one until it exits. The state lives in a
    ``ContextVar``, so other threads are unaffected.

    Args:
        mesh: the mesh activations are laid out on.
        rules_or_layout: a :class:`Rules` table; a layout string as ``train_step`` takes it
            (``"dp"``, ``"zero3+tp+sp"``, any order); or any object with an ``activation_rules``
            attribute holding one (a ``Layout``). ``None`` means no rules: only ``P`` specs can
            be constrained to.

    Yields:
        The active :class:`Context`.

    >>> with simulate(4), use(Mesh(dp=2, tp=2), Rules(batch="dp", embed=None)):
    ...     h = constrain(h, ("batch", "embed"))
    """
    if not isinstance(mesh, Mesh):
        raise sharding_error(
            f"expected a shardings.Mesh, got {type(mesh).__name__} {mesh!r}", fix="pass Mesh(...)", cls=TypeError
        )
    global _TRACED
    outer = _TRACED
    token = _CURRENT.set(Context(mesh, _activation_rules(rules_or_layout)))
    _TRACED = _CURRENT.get()
    try:
        yield _TRACED
    finally:
        _CURRENT.reset(token)
        _TRACED = outer


def current() -> Context | None:
    """The innermost active :class:`Context` (mesh, rules), or ``None`` outside :func:`use`.

    Traceable: under ``torch.compile`` (``train_step(jit=True)``) it reads the global mirror of the context that
    :func:`use` keeps, which dynamo guards on, instead of the ``ContextVar`` it cannot trace.
    """
    if torch.compiler.is_compiling():
        return _TRACED
    return _CURRENT.get()


def _spec_for(shape: tuple[int, ...], names_or_spec: P | Sequence[str | None], ctx: Context) -> P:
    if isinstance(names_or_spec, P):
        return names_or_spec  # checked against the mesh and shape by to_placements
    if isinstance(names_or_spec, Sequence) and not isinstance(names_or_spec, str) and len(names_or_spec) != len(shape):
        raise sharding_error(
            f"constrain got {len(names_or_spec)} logical names {tuple(names_or_spec)} for a tensor with "
            f"{len(shape)} dims",
            fix="give exactly one name (or None) per dim",
            shape=shape,
            mesh=ctx.mesh,
        )
    return logical_to_spec(names_or_spec, ctx.rules, ctx.mesh)


@functools.lru_cache(maxsize=4096)
def _layout(ctx: Context, is_spec: bool, names_or_spec: tuple, shape: tuple[int, ...]) -> tuple[P, tuple]:
    """The spec and placements ``constrain`` lays a ``shape`` tensor out to; computed once per model
    annotation (``is_spec`` keeps a ``P`` apart from an equal tuple of logical names)."""
    spec = _spec_for(shape, names_or_spec, ctx)
    return spec, to_placements(spec, ctx.mesh, shape)


def constrain(x: torch.Tensor, names_or_spec: P | Sequence[str | None]) -> torch.Tensor:
    """Lay an activation out as ``names_or_spec`` says: ``jax.lax.with_sharding_constraint``.

    Outside :func:`use` this returns ``x`` itself, unchanged. Inside, the spec is the ``P`` given,
    or the active rules applied to the logical names (one per dim), and ``x`` is redistributed
    to it with ``DTensor.redistribute``, which is differentiable: the gradient is redistributed
    back to ``x``'s layout in backward. A plain tensor (not a DTensor) is taken as the full,
    replicated value on every rank, so the result is always a DTensor on the active mesh. A
    ``Partial`` DTensor constrained to a sharded spec is reduce-scattered: this is how sequence
    parallelism appears after a row-parallel matmul.

    Args:
        x: the activation (a DTensor on the active mesh, or a plain tensor).
        names_or_spec: one logical name (or ``None``) per dim of ``x``, or a ``P``.

    Returns:
        ``x`` itself without an active mesh; otherwise a DTensor with the requested placements.

    Raises:
        ShardingError: the wrong number of names; a name with no rule; a spec the mesh cannot
            take; ``x`` lives on another device mesh.

    >>> constrain(x, ("batch", "embed")) is x  # no mesh active
    True
    """
    ctx = current()
    if ctx is None:
        return x
    x = resolve(x)  # a ZeRO-3 placeholder: gathered now
    shape = tuple(x.shape)
    if isinstance(names_or_spec, P | tuple | list):
        is_spec = isinstance(names_or_spec, P)
        # traced: the uncached function, which dynamo runs at trace time (the graph holds only its result)
        layout = _layout.__wrapped__ if torch.compiler.is_compiling() else _layout
        spec, placements = layout(ctx, is_spec, names_or_spec if is_spec else tuple(names_or_spec), shape)
    else:  # not a spec or names: _spec_for says what is wrong
        spec = _spec_for(shape, names_or_spec, ctx)
        placements = to_placements(spec, ctx.mesh, shape)
    x = on_mesh(
        x, ctx.mesh, what="the tensor passed to constrain", spec=spec,
        fix="constrain tensors of the active mesh only, or activate the tensor's mesh with shardings.use",
    )
    return constrain_to(x, placements)
