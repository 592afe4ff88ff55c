"""One format for every user-facing sharding error: where, what was expected, what came, the fix."""

from __future__ import annotations

from typing import Any

from core import tree

__all__ = ["ShardingError", "sharding_error"]


class ShardingError(ValueError):
    """A spec, mesh or layout that cannot work. Subclass of ``ValueError``."""


def sharding_error(
    problem: str,
    *,
    fix: str,
    path: Any = None,
    spec: Any = None,
    mesh: Any = None,
    shape: Any = None,
    cls: type[Exception] = ShardingError,
) -> Exception:
    """Build (not raise) an error whose message names the key path, spec and mesh, and ends with the fix.

    >>> str(sharding_error("unknown mesh axis 'x'", fix="use one of ('dp',)", spec="P('x')"))
    "P('x'): unknown mesh axis 'x'. Fix: use one of ('dp',)."
    """
    where = []
    if path is not None:
        where.append(f"at {path if isinstance(path, str) else tree.keystr(path) or '<root>'}")
    if spec is not None:
        text = spec if isinstance(spec, str) else repr(spec)
        where.append(f"spec {text}" if where else text)
    if shape is not None:
        where.append(f"shape {tuple(shape)}")
    if mesh is not None:
        where.append(f"mesh {mesh!r}")
    prefix = ", ".join(where)
    fix = fix.rstrip(".")
    return cls(f"{prefix + ': ' if prefix else ''}{problem}. Fix: {fix}.")
