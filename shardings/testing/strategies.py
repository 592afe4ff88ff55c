"""Hypothesis strategies for sharding tests: random meshes and valid specs for a shape.

>>> from hypothesis import given, strategies as st
>>> @given(st.data())
... def test_roundtrip(data):
...     mesh = data.draw(meshes(max_ranks=8))
...     spec = data.draw(specs((4, 6), mesh))
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hypothesis import strategies as st

from shardings.errors import sharding_error
from shardings.mesh import Mesh, P

__all__ = ["meshes", "specs"]

AXIS_NAMES = ("dp", "fsdp", "tp")


@st.composite
def meshes(draw: st.DrawFn, max_ranks: int = 8, max_axes: int = 3, axis_names: Sequence[str] = AXIS_NAMES) -> Mesh:
    """Meshes of 1 to ``max_axes`` axes drawn from ``axis_names`` (in any order), at most ``max_ranks`` ranks.

    Sizes include 1 (free axes); shrinking goes towards one small axis.

    Args:
        max_ranks: the largest product of axis sizes.
        max_axes: the most axes a mesh has (at most ``len(axis_names)``).
        axis_names: the names to pick axes from.
    """
    if max_ranks < 1 or max_axes < 1 or not axis_names:
        raise sharding_error(
            f"meshes(max_ranks={max_ranks}, max_axes={max_axes}, axis_names={tuple(axis_names)}) can draw nothing",
            fix="use max_ranks >= 1, max_axes >= 1 and at least one axis name",
        )
    n_axes = draw(st.integers(1, min(max_axes, len(axis_names))))
    names = draw(st.permutations(list(axis_names)))[:n_axes]
    sizes, budget = {}, max_ranks
    for name in names:
        sizes[name] = draw(st.integers(1, budget))
        budget //= sizes[name]
    return Mesh(sizes)


@st.composite
def specs(draw: st.DrawFn, shape: Sequence[int], mesh: Mesh) -> P:
    """Valid specs for a tensor of ``shape`` on ``mesh``, in every spelling ``P`` allows.

    Each mesh axis shards one dim or none; a dim split over several axes lists them in any order
    when the dim divides evenly over them (else in mesh order, the only layout DTensor keeps
    exact); single axes come as ``"a"`` or ``("a",)``; trailing ``None`` entries may be dropped.
    """
    dims: list[list[str]] = [[] for _ in shape]
    if shape:
        for name in draw(st.permutations(list(mesh.axis_names))):
            dim = draw(st.sampled_from([None, *range(len(shape))]))
            if dim is not None:
                dims[dim].append(name)
    entries: list[object] = []
    for size, axes in zip(shape, dims):
        if size % math.prod(mesh.shape[a] for a in axes):
            axes.sort(key=mesh.axis_names.index)
        if not axes:
            entries.append(None)
        elif len(axes) == 1:
            entries.append(draw(st.sampled_from([axes[0], (axes[0],)])))
        else:
            entries.append(tuple(axes))
    used = max((i + 1 for i, axes in enumerate(dims) if axes), default=0)
    return P(*entries[: draw(st.integers(used, len(shape)))])


@st.composite
def layouts(draw: st.DrawFn, mesh: Mesh | None = None) -> str:
    """Valid layout compositions (``"zero3+tp+sp"``...), restricted to what ``mesh`` can run when given.

    One data-parallel strategy (or none), optionally ``tp``, and ``sp`` only with ``tp``.
    """
    from shardings import layouts as _layouts

    def fits(name: str) -> bool:
        if mesh is None:
            return True
        try:
            _layouts.validate(_layouts.get(name), mesh)
        except ValueError:
            return False
        return True

    data = [d for d in ("dp", "zero1", "zero2", "zero3", "hsdp") if fits(d)]
    parts = [draw(st.sampled_from(data))] if data and draw(st.booleans() if fits("tp") else st.just(True)) else []
    if fits("tp") and (not parts or draw(st.booleans())):
        parts.append("tp")
        if draw(st.booleans()):
            parts.append("sp")
    if not parts:
        raise sharding_error(
            f"no layout preset fits {mesh!r}", fix="give the mesh a data axis ('dp'/'fsdp') or a 'tp' axis", mesh=mesh
        )
    return "+".join(parts)
