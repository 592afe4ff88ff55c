"""Layouts: which logical axis goes to which mesh axis, for each role a tensor can play.

A :class:`Layout` is six rule tables — param storage, param compute, grads, optimizer state,
batch and activations — and, as data, the presets it was built from. DP, ZeRO-1/2/3, HSDP, TP, SP,
CP, EP, PP and offload are presets (their table: :mod:`shardings.spec.presets`); ``+`` composes them
(``get("zero3+tp+sp")``). The train step reads the tables and the collectives follow: storage ≠
compute means all-gather before use; grads that must become replicated mean all-reduce, grads that
must become sharded mean reduce-scatter; and so on.

This module is the preset registry: :func:`register` records a preset with what it needs to compose
(its group of alternatives, mesh axes, companions, rule tier, whether it pipelines or composes with
the pipeline), :func:`get` composes presets by name and checks all of that, :func:`validate` checks a
mesh. Every question about a layout is answered from ``Layout.presets`` and ``Layout.pipelined``;
``Layout.name`` is for display and nothing parses it.
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import warnings
from collections.abc import Iterable

from shardings.spec.errors import sharding_error
from shardings.spec.mesh import Mesh
from shardings.spec.rules import Rules, register_preset_axes

__all__ = [
    "DATA_AXES",
    "LOGICAL_NAMES",
    "OFFLOADABLE",
    "PARAM_ROLES",
    "ROLES",
    "TIERS",
    "IdleAxisWarning",
    "Layout",
    "Preset",
    "get",
    "idle_axes",
    "names",
    "preset",
    "register",
    "register_alias",
    "register_combination",
    "resolve",
    "validate",
    "warn_idle_axes",
]

# Every logical name the models use (docs/layouts.md); each role's table ends by replicating them all.
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
ROLES = ("params", "compute", "grads", "opt_state", "batch", "activations")  # a layout's rule tables
PARAM_ROLES = ("params", "compute", "grads", "opt_state")  # the placements a parameter takes in a step
OFFLOADABLE = ("params", "opt_state")  # roles a layout may keep in host memory (Layout.host)
_REPLICATE_ALL = Rules([(n, None) for n in LOGICAL_NAMES])

# Rule priority inside a composition, first to last: every rule of a tier comes before the next tier's (the first
# rule that fits a name wins). Presets of one tier keep their registration order, so any spelling of a composition
# is the same layout.
TIERS = (
    "expert",  # ep: its expert -> ep beats tp's expert -> None, its batch rule beats the data presets'
    "data",  # dp, zero1/2/3, hsdp
    "tensor",  # tp
    "context_tensor",  # cp with sp: the residual stream's seq over (cp, tp), before cp's own seq -> cp
    "context",  # cp, cp_allgather
    "sequence",  # sp: after tp's rules, so attention and the MLP keep heads/mlp on tp and seq whole
    "pipeline",  # pp
    "user",  # register()'s default
    "offload",  # offload_optimizer, offload_params
)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Rule tables, one per role, and the presets they came from. ``a + b`` concatenates each table (``a``'s
    rules take priority).

    Attributes:
        params: where parameters live between steps (storage).
        compute: where parameters must be while the loss runs (storage ≠ compute: gather per use).
        grads: where reduced gradients go (replicated: all-reduce; sharded: reduce-scatter).
        opt_state: where optimizer moments live; the update runs in this layout.
        batch: where input batch tensors go (names ``("batch", "seq")``).
        activations: what ``constrain`` resolves activation names with.
        host: the roles that live in host memory (``"opt_state"``, ``"params"``): offloaded, as JAX's
            ``memory_kind="pinned_host"`` (the ``offload_optimizer`` and ``offload_params`` presets).
        presets: the presets it was built from, in canonical order (``get`` fills it; empty for a hand-made one).
        pipelined: whether a preset in it pipelines the model's blocks (``pp``): the train step then runs the
            pipeline path and ``shardings.init`` puts the parameters on the stage mesh.
    """

    params: Rules = dataclasses.field(default_factory=Rules)
    compute: Rules = dataclasses.field(default_factory=Rules)
    grads: Rules = dataclasses.field(default_factory=Rules)
    opt_state: Rules = dataclasses.field(default_factory=Rules)
    batch: Rules = dataclasses.field(default_factory=Rules)
    activations: Rules = dataclasses.field(default_factory=Rules)
    host: frozenset[str] = frozenset()
    presets: tuple[str, ...] = ()
    pipelined: bool = False

    def __post_init__(self) -> None:
        wrong = set(self.host) - set(OFFLOADABLE)
        if wrong:
            raise sharding_error(f"Layout(host={set(self.host)}): {sorted(wrong)} cannot live in host memory",
                                 fix=f"offload roles among {OFFLOADABLE}")

    @property
    def name(self) -> str:
        """The presets joined with ``+`` (``"zero3+tp+sp"``), for display; ``""`` for a hand-made layout."""
        return "+".join(self.presets)

    def __add__(self, other: Layout) -> Layout:
        if not isinstance(other, Layout):
            return NotImplemented
        tables = {r: getattr(self, r) + getattr(other, r) for r in ROLES}
        return Layout(**tables, host=self.host | other.host, presets=self.presets + other.presets,
                      pipelined=self.pipelined or other.pipelined)

    def role(self, role: str) -> Rules:
        """The complete table for ``role``: its rules, then replication for every logical name."""
        if role not in ROLES:
            raise ValueError(f"unknown layout role {role!r}; roles are {ROLES}")
        return getattr(self, role) + _REPLICATE_ALL

    @property
    def activation_rules(self) -> Rules:
        """What ``shardings.use(mesh, layout)`` resolves ``constrain`` names with."""
        return self.role("activations")

    def __repr__(self) -> str:
        return f"Layout({self.name!r})" if self.presets else super().__repr__()


@dataclasses.dataclass(frozen=True)
class Preset:
    """A registered preset: its rule tables and how it composes (:func:`register`'s arguments)."""

    layout: Layout
    group: str  # presets of one group are alternatives: two data-parallel strategies cannot compose
    needs: tuple[tuple[str, ...], ...] = ()  # each inner tuple: the mesh must have at least one of these axes
    requires: tuple[str, ...] = ()  # presets that must also be in the composition (sp requires tp)
    tier: str = "user"  # rule priority (TIERS)
    composes_with_pp: bool = False  # may run inside each pipeline stage
    pipeline: bool = False  # pipelines the blocks (pp): a layout with it is Layout.pipelined


_PRESETS: dict[str, Preset] = {}
_ALIASES: dict[str, str] = {}
_COMBINED: dict[frozenset[str], tuple[Layout, str]] = {}
_RANK_TIERS = {-10: "expert", 0: "data", 10: "tensor", 12: "context_tensor", 15: "context", 20: "sequence",
               30: "pipeline", 50: "user", 90: "offload"}  # the integer ranks tiers replaced (register(rank=))


def _tier(tier: str | None, rank: int | None, what: str) -> str:
    if rank is not None:  # deprecated: the tier at or below the old integer rank
        warnings.warn(f"{what}: rank= is deprecated; pass tier= one of {TIERS}", DeprecationWarning, stacklevel=3)
        ranks = sorted(_RANK_TIERS)
        tier = _RANK_TIERS[ranks[max(0, bisect.bisect_right(ranks, rank) - 1)]]
    tier = tier or "user"
    if tier not in TIERS:
        raise sharding_error(f"{what}: unknown tier {tier!r}", fix=f"pass tier= one of {TIERS}")
    return tier


def register(name: str, layout: Layout, *, group: str, needs: Iterable[Iterable[str]] = (),
             requires: Iterable[str] = (), tier: str | None = None, composes_with_pp: bool = False,
             pipeline: bool = False, after: Iterable[str] = (), rank: int | None = None) -> None:
    """Add a preset usable in :func:`get` compositions (e.g. a user's own ``"my_tp"``).

    The mesh axes its rules name become preset axes: skipped on a mesh that lacks them.

    Args:
        name: the preset's name.
        layout: its rule tables.
        group: presets of one group are alternatives (``"data"``: ``dp``, ``zero3``, ...).
        needs: per entry, mesh axes of which the mesh must have one (``(("tp",),)``).
        requires: presets that must also be in a composition with it (``sp`` requires ``tp``).
        tier: its rules' priority in a composition, one of :data:`TIERS` (default ``"user"``).
        composes_with_pp: whether it may run inside each pipeline stage (a layout with ``pp``).
        pipeline: whether it pipelines the model's blocks (``pp``'s own flag).
        after: the former name of ``requires``.
        rank: deprecated: the former integer priority (the tier at or below it).

    >>> register("mlp_tp", Layout(params=Rules(mlp="tp"), compute=Rules(mlp="tp")), group="tp",
    ...          needs=(("tp",),), tier="tensor")  # doctest: +SKIP
    """
    register_preset_axes(*(getattr(layout, r) for r in ROLES))
    tables = dataclasses.replace(layout, presets=(name,), pipelined=pipeline)
    _PRESETS[name] = Preset(tables, group, tuple(tuple(n) for n in needs), (*requires, *after),
                            _tier(tier, rank, f"register({name!r})"), composes_with_pp, pipeline)


def register_alias(alias: str, name: str) -> None:
    """Let ``alias`` stand for the preset ``name`` in :func:`get` (``fsdp`` for ``zero3``)."""
    _ALIASES[alias] = name


def register_combination(names: Iterable[str], layout: Layout, *, tier: str | None = None,
                         rank: int | None = None) -> None:
    """Extra rules that join a composition when all of ``names`` are in it, at priority ``tier``."""
    register_preset_axes(*(getattr(layout, r) for r in ROLES))
    _COMBINED[frozenset(names)] = (layout, _tier(tier, rank, f"register_combination({tuple(names)})"))


def names(aliases: bool = True) -> tuple[str, ...]:
    """The preset names :func:`get` accepts, in registration order, and their aliases unless ``aliases=False``."""
    return tuple(_PRESETS) + (tuple(_ALIASES) if aliases else ())


def preset(name: str) -> Preset:
    """The registered preset ``name`` (an alias resolved)."""
    return _PRESETS[_ALIASES.get(name, name)]


def _unknown(part: str, spec: object) -> str:
    close = difflib.get_close_matches(part, names(), n=1)
    return f"unknown layout preset {part!r} in {spec!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def get(spec: str | Layout | Iterable[str]) -> Layout:
    """A layout by preset name or ``"a+b+c"`` composition, in any order; a ``Layout`` passes through.

    Raises:
        ShardingError: an unknown preset (with the nearest name), two presets of one group (``dp+zero3``),
            a preset without one it requires (``sp`` without ``tp``), a pipeline preset with one that does
            not compose with it.

    >>> get("sp+tp+zero3").presets
    ('zero3', 'tp', 'sp')
    """
    if isinstance(spec, Layout):
        return spec
    parts = [p.strip() for p in (spec.split("+") if isinstance(spec, str) else spec)]
    for p in parts:
        if p not in _PRESETS and p not in _ALIASES:
            raise sharding_error(_unknown(p, spec),
                                 fix=f"use presets from {names()} joined with '+', e.g. 'zero3+tp+sp'")
    parts = [_ALIASES.get(p, p) for p in parts]
    groups: dict[str, str] = {}
    for p in parts:
        g = _PRESETS[p].group
        if g in groups:
            raise sharding_error(f"layout {spec!r} combines {groups[g]!r} and {p!r}, two {g} strategies",
                                 fix=f"keep one of {groups[g]!r} and {p!r}")
        groups[g] = p
        for needed in _PRESETS[p].requires:
            if needed not in parts:
                raise sharding_error(f"layout {spec!r}: preset {p!r} only works together with {needed!r}",
                                     fix=f"write '{'+'.join([*parts, needed])}'")
    _check_pipeline(spec, parts)
    registered = list(_PRESETS)
    tables = [(TIERS.index(_PRESETS[p].tier), registered.index(p), _PRESETS[p].layout) for p in parts]
    # Rules that only make sense when several presets meet (e.g. sp with cp) join at their own tier.
    tables += [(TIERS.index(t), -1, extra) for members, (extra, t) in _COMBINED.items() if members <= set(parts)]
    layout = Layout()
    for _, _, table in sorted(tables, key=lambda t: t[:2]):
        layout = layout + table  # combination tables add no preset
    return layout


def _check_pipeline(spec: object, parts: list[str]) -> None:
    """A pipeline preset composes only with presets registered as running inside its stages."""
    pipelines = [p for p in parts if _PRESETS[p].pipeline]
    other = sorted(p for p in parts if not _PRESETS[p].pipeline and not _PRESETS[p].composes_with_pp)
    if pipelines and other:
        inside = sorted(p for p, x in _PRESETS.items() if x.composes_with_pp)
        raise sharding_error(f"layout {spec!r}: {pipelines[0]} does not compose with {other} yet",
                             fix=f"use {pipelines[0]} with {inside}, e.g. 'dp+{pipelines[0]}'")


class IdleAxisWarning(UserWarning):
    """A mesh axis the layout leaves idle: its ranks hold and compute the same as each other."""


def _targets(layout: Layout) -> set[str]:
    """The mesh axes any of ``layout``'s rule tables names (``pp`` when it pipelines the blocks)."""
    axes = {a for role in ROLES for _, t in getattr(layout, role)
            for a in (() if t is None else (t,) if isinstance(t, str) else t)}
    return axes | ({"pp"} if layout.pipelined else set())


def idle_axes(layout: Layout, mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes of size > 1 that no rule table of ``layout`` names: every rank along one holds and computes
    exactly what its neighbours do (``zero3`` on ``Mesh(dp=2, tp=2)``: ``('tp',)``, twice ``Mesh(dp=4)``'s memory).

    >>> idle_axes(get("zero3"), Mesh(dp=2, tp=2)), idle_axes(get("zero3+tp"), Mesh(dp=2, tp=2))
    (('tp',), ())
    """
    used = _targets(layout)
    return tuple(a for a in mesh.axis_names if mesh.axis_size(a) > 1 and a not in used)


def _composes(layout: Layout, preset: str) -> bool:
    if not layout.presets or preset in layout.presets:
        return False
    try:
        get(f"{layout.name}+{preset}")
    except (ValueError, TypeError):
        return False
    return True


def warn_idle_axes(layout: Layout, mesh: Mesh) -> None:
    """Warn (:class:`IdleAxisWarning`, once per process, rank 0 only) about each of :func:`idle_axes`, naming the
    presets that would use it and the mesh without it."""
    import torch.distributed as dist  # the spec layer needs no process group otherwise

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    for axis in idle_axes(layout, mesh):
        users = [p for p, x in _PRESETS.items() if axis in _targets(x.layout) and _composes(layout, p)][:3]
        data = next((a for a in mesh.axis_names if a in DATA_AXES and a in _targets(layout)), None)
        fold = (f", or give its ranks to {data!r} (Mesh({data}={mesh.axis_size(data) * mesh.axis_size(axis)}, ...))"
                if data else "")
        add = f"add a preset that uses it ({' or '.join(f'{layout.name}+{p}' for p in users)})" if users else (
            "add a preset that uses it")
        warnings.warn(IdleAxisWarning(
            f"layout {layout.name or layout!r} leaves mesh axis {axis!r} (size {mesh.axis_size(axis)}) of {mesh!r} "
            f"idle: its ranks hold and compute the same, so each holds as much as on a mesh without it. "
            f"Fix: {add}{fold}."), stacklevel=3)


def validate(layout: Layout, mesh: Mesh) -> None:
    """Check that ``mesh`` has the axes ``layout``'s presets need; raise a clear error before any work."""
    for p in layout.presets:
        for alternatives in _PRESETS[p].needs if p in _PRESETS else ():
            if not any(a in mesh.axis_names for a in alternatives):
                want = alternatives[0] if len(alternatives) == 1 else " or ".join(map(repr, alternatives))
                raise sharding_error(
                    f"layout {layout.name!r}: preset {p!r} needs a mesh axis {want}, "
                    f"but the mesh has {mesh.axis_names}",
                    fix=f"add the axis to the mesh (e.g. Mesh({alternatives[0]}=2, ...)) or drop {p!r}",
                    mesh=mesh,
                )


_RESOLVED: set[tuple[Layout, tuple[str, ...]]] = set()  # (layout, mesh axes) already validated


def resolve(spec: str | Layout | Iterable[str], mesh: Mesh) -> Layout:
    """The one resolution of a run's layout on its mesh: :func:`get` and :func:`validate`, checked once per
    (layout, mesh axes) in a process. ``shardings.init`` and ``train_step`` call it (and ``experiments.build``);
    after the first, a ``Layout`` already checked on this mesh's axes passes straight through.

    Raises:
        ShardingError: as :func:`get` and :func:`validate`.
    """
    layout = get(spec)
    key = (layout, tuple(mesh.axis_names))
    if key not in _RESOLVED:
        validate(layout, mesh)
        _RESOLVED.add(key)
    return layout
