"""Hypothesis strategies for sharding tests: random meshes, valid specs for a shape, and layouts a mesh can run.

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

from shardings.spec.errors import sharding_error
from shardings.spec.mesh import Mesh, P

__all__ = ["ALL_AXIS_NAMES", "AXIS_NAMES", "layouts", "meshes", "specs"]

AXIS_NAMES = ("dp", "fsdp", "tp")  # meshes()' default: the data and tensor-parallel axes
ALL_AXIS_NAMES = (*AXIS_NAMES, "cp", "ep")  # every axis a preset uses: meshes(axis_names=ALL_AXIS_NAMES)


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
def layouts(draw: st.DrawFn, mesh: Mesh | None = None, *, context: bool | None = None,
            experts: bool | None = None) -> str:
    """Valid layout compositions (``"zero3+tp+sp"``, ``"hsdp+cp"``, ``"dp+tp+ep"``...), restricted to what
    ``mesh`` can run when given.

    One data-parallel strategy (or none), optionally ``tp``, ``sp`` only with ``tp``, optionally one
    context-parallel strategy (``cp`` or ``cp_allgather``), optionally ``ep``; never nothing.

    Args:
        mesh: draw only presets whose axes the mesh has.
        context: draw ``cp``/``cp_allgather`` (the model must run ring attention, and its sequence
            length divide ``2·cp``). Default: when ``mesh`` has a ``cp`` axis; never without a mesh.
        experts: draw ``ep``. Only a model with expert weights (``models.moe``) has anything to put on
            ``ep``; for any other, ``ep`` is one more data axis, so pass ``False`` for such a model.
            Default: when ``mesh`` has an ``ep`` axis; never without a mesh.

    Without ``cp``/``ep`` axes (and without a mesh) the draws are exactly those of the strategy before
    ``context``/``experts`` existed: the same examples for the same seed.
    """
    from shardings.spec import layouts as _layouts

    def fits(name: str) -> bool:
        if mesh is None:
            return True
        try:
            _layouts.validate(_layouts.get(name), mesh)
        except ValueError:
            return False
        return True

    def wanted(flag: bool | None, axis: str) -> bool:
        return (mesh is not None and axis in mesh.axis_names) if flag is None else flag

    cps = [c for c in ("cp", "cp_allgather") if fits(c)] if wanted(context, "cp") else []
    ep = wanted(experts, "ep") and fits("ep")
    extra = bool(cps) or ep  # another part can make the layout: data and tp become optional
    data = [d for d in ("dp", "zero1", "zero2", "zero3", "hsdp") if fits(d)]
    optional_data = fits("tp") or extra
    parts = [draw(st.sampled_from(data))] if data and draw(st.booleans() if optional_data else st.just(True)) else []
    if fits("tp") and ((not parts and not extra) or draw(st.booleans())):
        parts.append("tp")
        if draw(st.booleans()):
            parts.append("sp")
    if cps:
        cp = draw(st.sampled_from([None, *cps]) if parts or ep else st.sampled_from(cps))
        parts += [cp] if cp else []
    if ep and (not parts or draw(st.booleans())):
        parts.append("ep")
    if not parts:
        raise sharding_error(
            f"no layout preset fits {mesh!r}",
            fix="give the mesh a data axis ('dp'/'fsdp'), a 'tp' axis, or a 'cp'/'ep' axis with context/experts",
            mesh=mesh,
        )
    name = "+".join(parts)
    _layouts.get(name)  # a valid composition (raises otherwise: a bug in this strategy)
    return name
