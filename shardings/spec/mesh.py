"""``Mesh``, ``P`` and ``NamedSharding``: the spec language's nouns, validated eagerly.

A ``Mesh`` is an ordered table of named axis sizes; it becomes a torch ``DeviceMesh`` only when
a process group (real or simulated) is running. A ``P`` has one entry per tensor dim: ``None``
(replicated), an axis name, or a tuple of axis names (major to minor).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardings.runtime.compat import clear_sharding_prop_cache
from shardings.spec.errors import ShardingError, sharding_error

__all__ = ["Mesh", "NamedSharding", "P", "axis_of_group", "register_group", "validate_spec"]

Entry = None | str | tuple[str, ...]

# DeviceMeshes built for the running process group; cleared when a runtime tears its group down.
_DEVICE_MESHES: dict[tuple[Any, ...], DeviceMesh] = {}
# id(DeviceMesh) -> the Mesh it was built for (which also knows the size-1 axes the DeviceMesh lacks).
_MESHES: dict[int, Mesh] = {}
# Process-group name -> mesh axis label ("tp", or "dp+tp" for a flattened group), for accounting.
_GROUP_AXES: dict[str, str] = {}


def _clear_device_meshes() -> None:
    """Forget the meshes of a runtime that ended (simulate's exit, a launched rank's teardown)."""
    _DEVICE_MESHES.clear()
    _MESHES.clear()
    _GROUP_AXES.clear()
    # DTensor's sharding-propagation caches key on equal (not identical) meshes: left alone, the next runtime's
    # ops would hand out output specs holding this runtime's DeviceMesh, and plans keyed on it split wrongly
    clear_sharding_prop_cache()


def register_group(group_name: str, axis_label: str) -> None:
    """Record which mesh axis (or ``"a+b"`` for a flattened tuple) a process group spans."""
    _GROUP_AXES[group_name] = axis_label


def mesh_of_device_mesh(device_mesh: DeviceMesh) -> Mesh | None:
    """The ``Mesh`` a device mesh was built for (``None`` if ``Mesh.device_mesh`` did not build it)."""
    return _MESHES.get(id(device_mesh))


def axis_of_group(group_name: str) -> str | None:
    """The mesh axis label a process group was registered under, or ``None``."""
    return _GROUP_AXES.get(group_name)


class Mesh:
    """Named mesh axes over the ranks of the running process group.

    Args:
        sizes: axis name → size, in major-to-minor order (a mapping or ``(name, size)`` pairs).
        **kw_sizes: the same, as keywords: ``Mesh(dp=2, tp=2)``.

    Size-1 axes are allowed and free. The product of sizes must equal the world size when the
    mesh is used under a process group.

    >>> Mesh(dp=2, tp=4)
    Mesh(dp=2, tp=4)
    >>> Mesh({"dp": 2, "tp": 4}).size
    8
    """

    def __init__(self, sizes: Mapping[str, int] | Iterable[tuple[str, int]] | None = None, /, **kw_sizes: int):
        pairs = list(sizes.items() if isinstance(sizes, Mapping) else (sizes or ())) + list(kw_sizes.items())
        if not pairs:
            raise sharding_error("a mesh needs at least one axis", fix="write e.g. Mesh(dp=2)")
        seen: set[str] = set()
        for name, size in pairs:
            if not isinstance(name, str) or not name.isidentifier():
                raise sharding_error(
                    f"mesh axis name {name!r} is not a non-empty identifier string",
                    fix="name axes like 'dp', 'fsdp', 'tp'",
                    cls=TypeError if not isinstance(name, str) else ShardingError,
                )
            if name in seen:
                raise sharding_error(
                    f"mesh axis {name!r} appears twice in {pairs}", fix="give each axis one unique name"
                )
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise sharding_error(
                    f"mesh axis {name!r} has size {size!r}; expected a positive int",
                    fix="use sizes >= 1 (size-1 axes are free)",
                    cls=TypeError if isinstance(size, bool) or not isinstance(size, int) else ShardingError,
                )
            seen.add(name)
        self._shape = dict(pairs)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self._shape)

    @property
    def shape(self) -> dict[str, int]:
        """Axis name → size, in mesh order (a copy)."""
        return dict(self._shape)

    @property
    def size(self) -> int:
        return math.prod(list(self._shape.values()))

    def axis_size(self, axes: Entry) -> int:
        """Number of ranks along one axis or a tuple of axes (1 for ``None``)."""
        names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        for name in names:
            if name not in self._shape:
                raise sharding_error(f"unknown mesh axis {name!r}", fix=f"use one of {self.axis_names}", mesh=self)
        return math.prod([self._shape[n] for n in names])

    @property
    def device_axes(self) -> tuple[str, ...]:
        """The axes the torch ``DeviceMesh`` has: those of size > 1 (or the first axis, if all are 1).

        Size-1 axes are free: they shard nothing, so they get no device-mesh dim, no process group,
        and cost DTensor's sharding propagation nothing (its work grows fast with mesh dims).
        """
        return tuple(n for n, size in self._shape.items() if size > 1) or self.axis_names[:1]

    @property
    def device_mesh(self) -> DeviceMesh:
        """The torch ``DeviceMesh`` (over :attr:`device_axes`) for the running process group, built once."""
        if not dist.is_initialized():
            raise sharding_error(
                f"{self!r} needs {self.size} ranks but no process group is running",
                fix=f"run inside `with shardings.simulate({self.size}):` or `shardings.launch(fn, {self.size})`",
                cls=RuntimeError,
            )
        world = dist.get_world_size()
        if world != self.size:
            raise sharding_error(
                f"the mesh has {self.size} ranks but the world size is {world}",
                fix=f"make the axis sizes multiply to {world}, or run with {self.size} ranks",
                mesh=self,
            )
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        key = (device_type, tuple(self._shape.items()))
        if key not in _DEVICE_MESHES:
            axes = self.device_axes
            dm = init_device_mesh(device_type, tuple(self._shape[n] for n in axes), mesh_dim_names=axes)
            for name in axes:
                register_group(dm.get_group(name).group_name, name)
            _DEVICE_MESHES[key] = dm
            _MESHES[id(dm)] = self
        return _DEVICE_MESHES[key]

    def without(self, axis: str) -> Mesh:
        """The mesh of the other axes, as the ranks sharing this rank's ``axis`` coordinate see it.

        A pipeline stage's mesh: on ``Mesh(dp=2, pp=2, tp=2)``, ``without("pp")`` is a ``(dp=2, tp=2)``
        mesh whose device mesh is the slice of this one holding this rank (``device_mesh["dp", "tp"]``).

        >>> Mesh(dp=2, pp=2, tp=2).without("pp")
        Mesh(dp=2, tp=2)
        """
        if axis not in self._shape:
            raise sharding_error(f"unknown mesh axis {axis!r}", fix=f"use one of {self.axis_names}", mesh=self)
        rest = [(n, k) for n, k in self._shape.items() if n != axis] or [("dp", 1)]
        return _Slice(self, rest)

    def __repr__(self) -> str:
        return "Mesh(" + ", ".join(f"{k}={v}" for k, v in self._shape.items()) + ")"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and tuple(self._shape.items()) == tuple(other._shape.items())

    def __hash__(self) -> int:
        return hash(tuple(self._shape.items()))


class _Slice(Mesh):
    """:meth:`Mesh.without`'s result: its device mesh is a slice of the parent's (size-1 axes kept as dims)."""

    def __init__(self, parent: Mesh, sizes: list[tuple[str, int]]):
        super().__init__(sizes)
        self._parent = parent

    @property
    def device_mesh(self) -> DeviceMesh:
        self._parent.device_mesh  # noqa: B018  (the parent's checks: a process group of the right size)
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        key = (device_type, "slice", tuple(self._parent.shape.items()), tuple(self._shape.items()))
        if key not in _DEVICE_MESHES:
            keep = self.device_axes
            # every axis of the parent and the slice's size-1 axis (if any), so slicing can keep it as a dim
            axes = [(n, k) for n, k in self._parent.shape.items() if k > 1 or n in keep]
            if not all(n in dict(axes) for n in keep):
                axes = [(n, 1) for n in keep if n not in dict(axes)] + axes
            full = init_device_mesh(device_type, tuple(k for _, k in axes), mesh_dim_names=tuple(n for n, _ in axes))
            dm = full[keep] if len(keep) > 1 else full[keep[0]]
            for name in keep:
                register_group(dm.get_group(name).group_name, name)
            _DEVICE_MESHES[key] = dm
            _MESHES[id(dm)] = self
        return _DEVICE_MESHES[key]


class P(tuple):
    """A partition spec: one entry per tensor dim, each ``None``, an axis name or a tuple of names.

    Trailing ``None`` entries may be left out. An axis may shard at most one dim.

    >>> P("dp", None, ("tp", "sp"))
    P('dp', None, ('tp', 'sp'))
    >>> P("dp", None).normalized() == P("dp")
    True
    """

    def __new__(cls, *entries: Entry) -> P:
        for i, e in enumerate(entries):
            names = e if isinstance(e, tuple) else (e,)
            if e is not None and not all(isinstance(n, str) for n in names):
                raise sharding_error(
                    f"entry {i} is {e!r}; each entry must be None, an axis name (str) or a tuple of names",
                    fix="write e.g. P('dp', None, ('tp', 'sp'))",
                    spec="P" + repr(tuple(entries)),
                    cls=TypeError,
                )
        self = super().__new__(cls, entries)
        owner: dict[str, int] = {}
        for i, names in enumerate(self.dim_axes()):
            for n in names:
                if n in owner:
                    raise sharding_error(
                        f"mesh axis {n!r} is used twice (dims {owner[n]} and {i}); an axis can shard one dim only",
                        fix="remove one of the uses, or shard the second dim over another axis",
                        spec=self,
                    )
                owner[n] = i
        return self

    def dim_axes(self) -> tuple[tuple[str, ...], ...]:
        """Per dim, the tuple of mesh axes sharding it (empty when replicated)."""
        return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in self)

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis the spec uses, in dim order."""
        return tuple(n for names in self.dim_axes() for n in names)

    def normalized(self) -> P:
        """Canonical form: 1-tuples become names, empty tuples ``None``, trailing ``None``s dropped."""
        entries = [None if not names else names[0] if len(names) == 1 else names for names in self.dim_axes()]
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"

    def __reduce__(self) -> tuple[Any, ...]:
        return (P, tuple(self))


def validate_spec(spec: Any, mesh: Mesh, shape: Iterable[int] | int | None = None, path: Any = None) -> P:
    """Check ``spec`` against ``mesh`` (and a tensor ``shape``, or only its number of dims); return it as a ``P``.

    Raises:
        TypeError: ``spec`` is not a ``P`` (or ``None``).
        ValueError: an unknown axis, or more entries than the tensor has dims.
    """
    if spec is None:
        spec = P()
    if not isinstance(spec, P):
        raise sharding_error(
            f"expected a P(...) spec, got {type(spec).__name__} {spec!r}",
            fix="wrap the entries in shardings.P(...)",
            path=path,
            mesh=mesh,
            cls=TypeError,
        )
    for n in spec.axes:
        if n not in mesh.axis_names:
            raise sharding_error(
                f"unknown mesh axis {n!r}; the mesh has axes {mesh.axis_names}",
                fix="use one of the mesh's axis names, or add the axis to the Mesh",
                path=path,
                spec=spec,
                mesh=mesh,
            )
    if shape is not None:
        ndim, shape = (shape, None) if isinstance(shape, int) else (len(tuple(shape)), tuple(shape))
        if len(spec) > ndim:
            raise sharding_error(
                f"the spec has {len(spec)} entries but the tensor has only {ndim} dim(s)",
                fix=f"give at most {ndim} entries, one per dim (trailing None may be left out)",
                path=path,
                spec=spec,
                mesh=mesh,
                shape=shape,
            )
    return spec


class NamedSharding:
    """A spec bound to a mesh, validated on construction.

    >>> NamedSharding(Mesh(dp=2), P("dp")).spec
    P('dp')
    """

    def __init__(self, mesh: Mesh, spec: P):
        if not isinstance(mesh, Mesh):
            raise sharding_error(
                f"expected a shardings.Mesh, got {type(mesh).__name__}", fix="pass Mesh(...)", cls=TypeError
            )
        self.mesh = mesh
        self.spec = validate_spec(spec, mesh)

    def __repr__(self) -> str:
        return f"NamedSharding({self.mesh!r}, {self.spec!r})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, NamedSharding)
            and self.mesh == other.mesh
            and self.spec.normalized() == other.spec.normalized()
        )

    def __hash__(self) -> int:
        return hash((self.mesh, self.spec.normalized()))
