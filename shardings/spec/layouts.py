"""Layouts: which logical axis goes to which mesh axis, for each role a tensor can play.

A :class:`Layout` is six rule tables — param storage, param compute, grads, optimizer state,
batch and activations — and nothing else. DP, ZeRO-1/2/3, HSDP, TP and SP are presets; ``+``
composes them (``get("zero3+tp+sp")``). The train step reads the tables and the collectives
follow: storage ≠ compute means all-gather before use; grads that must become replicated mean
all-reduce, grads that must become sharded mean reduce-scatter; and so on.

The data-parallel presets reduce over every data axis the mesh has — ``dp`` and ``fsdp`` — so
``zero3`` on ``Mesh(dp=2, fsdp=2)`` shards over 4 ranks, while ``hsdp`` shards over ``fsdp``
and replicates over ``dp``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from shardings.spec.errors import sharding_error
from shardings.spec.mesh import Mesh
from shardings.spec.rules import Rules, register_preset_axes

__all__ = ["DATA_AXES", "LOGICAL_NAMES", "Layout", "get", "names", "register", "register_combination", "validate"]

# Every logical name the models use (DESIGN §4); each role's table ends by replicating them all.
# "block_seq" is the sequence dim of a normalized activation entering a tensor-parallel matmul:
# sequence parallelism shards the residual stream's "seq" but gathers "block_seq".
LOGICAL_NAMES = (
    "batch",
    "seq",
    "block_seq",
    "embed",
    "heads",
    "kv_heads",
    "head_dim",
    "mlp",
    "vocab",
    "expert",
    "layers",
)
DATA_AXES = ("dp", "fsdp")
_REPLICATE_ALL = Rules([(n, None) for n in LOGICAL_NAMES])
_ROLES = ("params", "compute", "grads", "opt_state", "batch", "activations")
OFFLOADABLE = ("params", "opt_state")  # roles a layout may keep in host memory (Layout.host)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Rule tables, one per role. ``a + b`` concatenates each table (``a``'s rules take priority).

    Attributes:
        params: where parameters live between steps (storage).
        compute: where parameters must be while the loss runs (storage ≠ compute: gather per use).
        grads: where reduced gradients go (replicated: all-reduce; sharded: reduce-scatter).
        opt_state: where optimizer moments live; the update runs in this layout.
        batch: where input batch tensors go (names ``("batch", "seq")``).
        activations: what ``constrain`` resolves activation names with.
        host: the roles that live in host memory (``"opt_state"``, ``"params"``): offloaded, as JAX's
            ``memory_kind="pinned_host"`` (the ``offload_optimizer`` and ``offload_params`` presets).
        name: the preset names it was built from, for display.
    """

    params: Rules = dataclasses.field(default_factory=Rules)
    compute: Rules = dataclasses.field(default_factory=Rules)
    grads: Rules = dataclasses.field(default_factory=Rules)
    opt_state: Rules = dataclasses.field(default_factory=Rules)
    batch: Rules = dataclasses.field(default_factory=Rules)
    activations: Rules = dataclasses.field(default_factory=Rules)
    host: frozenset[str] = frozenset()
    name: str = ""

    def __post_init__(self) -> None:
        wrong = set(self.host) - set(OFFLOADABLE)
        if wrong:
            raise sharding_error(f"Layout(host={set(self.host)}): {sorted(wrong)} cannot live in host memory",
                                 fix=f"offload roles among {OFFLOADABLE}")

    def __add__(self, other: Layout) -> Layout:
        if not isinstance(other, Layout):
            return NotImplemented
        tables = {r: getattr(self, r) + getattr(other, r) for r in _ROLES}
        return Layout(**tables, host=self.host | other.host, name="+".join(n for n in (self.name, other.name) if n))

    def role(self, role: str) -> Rules:
        """The complete table for ``role``: its rules, then replication for every logical name."""
        if role not in _ROLES:
            raise ValueError(f"unknown layout role {role!r}; roles are {_ROLES}")
        return getattr(self, role) + _REPLICATE_ALL

    @property
    def activation_rules(self) -> Rules:
        """What ``shardings.use(mesh, layout)`` resolves ``constrain`` names with."""
        return self.role("activations")

    def __repr__(self) -> str:
        return f"Layout({self.name!r})" if self.name else super().__repr__()


@dataclasses.dataclass(frozen=True)
class _Preset:
    layout: Layout
    group: str  # presets of one group are alternatives: two data-parallel strategies cannot compose
    needs: tuple[tuple[str, ...], ...] = ()  # each inner tuple: the mesh must have at least one of these axes
    after: tuple[str, ...] = ()  # presets that must also be in the composition
    rank: int = 0  # canonical order inside a composition (rule priority)


_PRESETS: dict[str, _Preset] = {}
_COMBINED: dict[frozenset[str], tuple[Layout, int]] = {}


def register(name: str, layout: Layout, *, group: str, needs=(), after=(), rank: int = 50) -> None:
    """Add a preset usable in :func:`get` compositions (e.g. a user's own ``"my_tp"``).

    The mesh axes its rules name become preset axes: skipped on a mesh that lacks them.
    """
    register_preset_axes(*(getattr(layout, r) for r in _ROLES))
    _PRESETS[name] = _Preset(dataclasses.replace(layout, name=name), group, tuple(needs), tuple(after), rank)


def register_combination(names: tuple[str, ...], layout: Layout, *, rank: int) -> None:
    """Extra rules that join a composition when all of ``names`` are in it, at priority ``rank``."""
    register_preset_axes(*(getattr(layout, r) for r in _ROLES))
    _COMBINED[frozenset(names)] = (layout, rank)


def _shard_params_over(axes) -> Rules:
    # The first of these dims a tensor has is sharded over the data axes; the others are fallbacks
    # for tensors without an embed dim (a vocab-only or mlp-only tensor).
    return Rules([("embed", axes), ("vocab", axes), ("mlp", axes), ("heads", axes), ("kv_heads", axes)])


_DATA = Rules([("batch", DATA_AXES)])
_SHARDED = _shard_params_over(DATA_AXES)
_TP = Rules([("heads", "tp"), ("kv_heads", "tp"), ("mlp", "tp"), ("vocab", "tp"), ("expert", None)])
_NEEDS_DATA = (DATA_AXES,)

register("dp", Layout(batch=_DATA, activations=_DATA), group="data", needs=_NEEDS_DATA, rank=0)
register("zero1", Layout(opt_state=_SHARDED, batch=_DATA, activations=_DATA), group="data", needs=_NEEDS_DATA, rank=0)
register(
    "zero2",
    Layout(opt_state=_SHARDED, grads=_SHARDED, batch=_DATA, activations=_DATA),
    group="data",
    needs=_NEEDS_DATA,
    rank=0,
)
register(
    "zero3",
    Layout(params=_SHARDED, grads=_SHARDED, opt_state=_SHARDED, batch=_DATA, activations=_DATA),
    group="data",
    needs=_NEEDS_DATA,
    rank=0,
)
_HSDP = _shard_params_over("fsdp")
register(
    "hsdp",
    Layout(params=_HSDP, grads=_HSDP, opt_state=_HSDP, batch=_DATA, activations=_DATA),
    group="data",
    needs=(("fsdp",),),
    rank=0,
)
register(
    "tp",
    Layout(params=_TP, compute=_TP, grads=_TP, opt_state=_TP, activations=_TP),
    group="tp",
    needs=(("tp",),),
    rank=10,
)
# Sequence parallelism: the residual stream's seq dim goes to tp. Its rule comes after tp's, so
# inside attention/MLP (where heads/mlp already hold tp) seq stays whole.
register("sp", Layout(activations=Rules([("seq", "tp")])), group="sp", needs=(("tp",),), after=("tp",), rank=20)
# Pipeline parallelism: the blocks' index (logical name "layers", the i of params["blocks"][i]) on mesh axis pp.
# No tensor has that dim, so the tables place nothing: the train step splits the blocks into stages and runs
# the other presets inside each stage (shardings.step.pipeline_step).
_PP = Rules([("layers", "pp")])
register("pp", Layout(params=_PP, compute=_PP, grads=_PP, opt_state=_PP), group="pp", needs=(("pp",),), rank=30)
# Offload: a role in host memory. Composes with every other preset (ZeRO-Offload is "zero2+offload_optimizer").
register("offload_optimizer", Layout(host=frozenset({"opt_state"})), group="offload_optimizer", rank=90)
register("offload_params", Layout(host=frozenset({"params"})), group="offload_params", rank=91)
_ALIASES = {"fsdp": "zero3", "ddp": "dp"}


def names() -> tuple[str, ...]:
    """The preset names (and aliases) :func:`get` accepts."""
    return tuple(_PRESETS) + tuple(_ALIASES)


def get(spec: str | Layout | Iterable[str]) -> Layout:
    """A layout by preset name or ``"a+b+c"`` composition; a ``Layout`` passes through.

    Raises:
        ShardingError: an unknown preset, two presets of one group (``dp+zero3``), a preset
            without one it needs (``sp`` without ``tp``).

    >>> get("zero3+tp+sp").name
    'zero3+tp+sp'
    """
    if isinstance(spec, Layout):
        return spec
    parts = spec.split("+") if isinstance(spec, str) else list(spec)
    parts = [_ALIASES.get(p.strip(), p.strip()) for p in parts]
    for p in parts:
        if p not in _PRESETS:
            raise sharding_error(
                f"unknown layout preset {p!r} in {spec!r}",
                fix=f"use presets from {names()} joined with '+', e.g. 'zero3+tp+sp'",
            )
    groups: dict[str, str] = {}
    for p in parts:
        g = _PRESETS[p].group
        if g in groups:
            raise sharding_error(
                f"layout {spec!r} combines {groups[g]!r} and {p!r}, two {g} strategies",
                fix=f"keep one of {groups[g]!r} and {p!r}",
            )
        groups[g] = p
        for needed in _PRESETS[p].after:
            if needed not in parts:
                raise sharding_error(
                    f"layout {spec!r}: preset {p!r} only works together with {needed!r}",
                    fix=f"write '{'+'.join([*parts, needed])}'",
                )
    # Rules that only make sense when several presets meet (e.g. sp with cp) join at their own rank.
    tables = [(_PRESETS[p].rank, parts.index(p), _PRESETS[p].layout) for p in parts]
    tables += [(rank, -1, extra) for members, (extra, rank) in _COMBINED.items() if members <= set(parts)]
    layout = Layout()
    for _, _, table in sorted(tables, key=lambda t: t[:2]):
        layout = layout + table  # unnamed combination tables add no name
    return layout


def validate(layout: Layout, mesh: Mesh) -> None:
    """Check that ``mesh`` has the axes ``layout``'s presets need; raise a clear error before any work."""
    for p in layout.name.split("+") if layout.name else ():
        for alternatives in _PRESETS[p].needs if p in _PRESETS else ():
            if not any(a in mesh.axis_names for a in alternatives):
                want = alternatives[0] if len(alternatives) == 1 else " or ".join(map(repr, alternatives))
                raise sharding_error(
                    f"layout {layout.name!r}: preset {p!r} needs a mesh axis {want}, "
                    f"but the mesh has {mesh.axis_names}",
                    fix=f"add the axis to the mesh (e.g. Mesh({alternatives[0]}=2, ...)) or drop {p!r}",
                    mesh=mesh,
                )


import shardings.spec.layouts_cp_ep  # noqa: E402, F401  (registers the cp, cp_allgather and ep presets)
