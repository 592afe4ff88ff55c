"""The one place where a ``P`` becomes DTensor placements, and back.

Every other module speaks ``P`` and logical names; only this module knows about ``Shard``,
``Replicate`` and ``Partial``.
"""

from __future__ import annotations

from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from shardings.errors import sharding_error
from shardings.mesh import Mesh, P, validate_spec

__all__ = ["to_placements"]


def to_placements(spec: P, mesh: Mesh, ndim: int | None = None, path=None) -> tuple[Placement, ...]:
    """One placement per mesh axis (mesh order) for ``spec``.

    >>> to_placements(P(None, "tp"), Mesh(dp=2, tp=2))
    (Replicate(), Shard(dim=1))
    """
    spec = validate_spec(spec, mesh, None if ndim is None else (0,) * ndim, path=path)
    placements: list[Placement] = [Replicate()] * len(mesh.axis_names)
    for dim, names in enumerate(spec.dim_axes()):
        order = [mesh.axis_names.index(n) for n in names]
        if order != sorted(order):
            raise sharding_error(
                f"dim {dim} is split over {names}, not in the mesh's axis order {mesh.axis_names}",
                fix="list the axes in mesh order",
                path=path,
                spec=spec,
                mesh=mesh,
            )
        for i in order:
            placements[i] = Shard(dim)
    return tuple(placements)
