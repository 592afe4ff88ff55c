"""Logical axis rules: name tensor dims once (``"batch"``, ``"embed"``, ``"mlp"``), map names to mesh axes by table.

A model says *what* each dim is; a :class:`Rules` table says *where* each kind of dim goes, with
fallbacks, as Flax/T5X/MaxText do. :func:`logical_to_spec` resolves one tensor's names to a ``P``;
:func:`annotate` names the dims of a tree you did not write (a Hugging Face state dict) by regex
over key paths, and :func:`logical_to_specs` turns a whole names tree into a spec tree.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from core import tree as pytree
from shardings.runtime.compat import pytree as torch_pytree
from shardings.spec.errors import sharding_error
from shardings.spec.mesh import Entry, Mesh, P

__all__ = [
    "Names",
    "Rules",
    "annotate",
    "is_names",
    "logical_to_spec",
    "logical_to_specs",
    "path_str",
    "register_preset_axes",
]

Names = tuple[str | None, ...]  # one logical name (or None: replicated) per tensor dim

# Mesh axes that some registered layout preset names (``shardings.spec.layouts.register`` adds them). A
# rule may target one of these on a mesh without it: one preset table serves every mesh. Any other
# axis the mesh lacks can only be a typo (``Rules(batch="dpp")``), and is an error.
_PRESET_AXES: set[str] = set()


def register_preset_axes(*rules: Rules) -> None:
    """Record the mesh axes ``rules`` target as a layout preset's: skipped, not refused, on meshes without them."""
    _PRESET_AXES.update(a for table in rules for _, target in table for a in _axes(target))


def _axes(target: Entry) -> tuple[str, ...]:
    return () if target is None else (target,) if isinstance(target, str) else tuple(target)


def _entry(axes: Sequence[str]) -> Entry:
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _check_rule(name: Any, target: Any) -> tuple[str, Entry]:
    target = tuple(target) if isinstance(target, list) else target
    ok_target = (
        target is None
        or isinstance(target, str)
        or (isinstance(target, tuple) and all(isinstance(a, str) for a in target))
    )
    if not isinstance(name, str) or not name or not ok_target:
        raise sharding_error(
            f"bad rule ({name!r}, {target!r}); a rule is (logical name, None | mesh axis | tuple of mesh axes)",
            fix="write e.g. ('batch', ('dp', 'fsdp')), ('mlp', 'tp') or ('embed', None)",
            cls=TypeError,
        )
    axes = _axes(target)
    if len(set(axes)) != len(axes):
        raise sharding_error(
            f"rule ({name!r}, {target!r}) lists a mesh axis twice", fix="list each mesh axis once per rule"
        )
    return name, _entry(axes)


class Rules:
    """An ordered logical-name → mesh-axes table with fallbacks. Immutable; ``+`` concatenates.

    A logical name may appear several times: its later rules are fallbacks, taken when the
    mesh axes of the earlier ones are already used by another dim of the same tensor (see
    :func:`logical_to_spec`). A target of ``None`` means replicated.

    Args:
        rules: ``(name, target)`` pairs in priority order, or a mapping (one rule per name).
        **simple: more rules as keywords, after ``rules``: ``Rules(batch=("dp", "fsdp"), mlp="tp")``.

    >>> r = Rules([("embed", "fsdp"), ("mlp", "fsdp"), ("mlp", "tp")]) + Rules(batch="dp")
    >>> r.targets("mlp")
    ('fsdp', 'tp')
    >>> r.replace(mlp=None)
    Rules([('embed', 'fsdp'), ('mlp', None), ('batch', 'dp')])
    """

    __slots__ = ("_table",)
    _table: tuple[tuple[str, Entry], ...]

    def __init__(self, rules: Mapping[str, Entry] | Iterable[tuple[str, Entry]] = (), /, **simple: Entry):
        pairs = list(rules.items() if isinstance(rules, Mapping) else rules) + list(simple.items())
        for pair in pairs:
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                raise sharding_error(
                    f"bad rule {pair!r}; expected a (logical name, mesh axes) pair",
                    fix="write e.g. Rules([('batch', 'dp'), ('mlp', 'tp')])",
                    cls=TypeError,
                )
        object.__setattr__(self, "_table", tuple(_check_rule(n, t) for n, t in pairs))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Rules are immutable; build new ones with + or .replace(...)")

    @property
    def names(self) -> tuple[str, ...]:
        """The logical names with at least one rule, in first-appearance order."""
        return tuple(dict.fromkeys(n for n, _ in self._table))

    def targets(self, name: str) -> tuple[Entry, ...]:
        """The targets for ``name`` in priority order (empty when there is no rule)."""
        return tuple(t for n, t in self._table if n == name)

    def replace(self, **targets: Entry) -> Rules:
        """A copy where each given name has exactly one rule, to the given target.

        The new rule sits where the name's first rule was (at the end for a new name). To give
        a name several fallbacks instead, prepend them: ``Rules([("embed", "tp"), ("embed", None)]) + rules``.

        >>> Rules([("embed", "fsdp"), ("embed", None), ("mlp", "tp")]).replace(embed="tp")
        Rules([('embed', 'tp'), ('mlp', 'tp')])
        """
        out: list[tuple[str, Entry]] = []
        for name, target in self._table:
            if name not in targets:
                out.append((name, target))
            elif name not in (n for n, _ in out):  # the name's first rule: put the replacement here
                out.append((name, targets[name]))
        out.extend((n, t) for n, t in targets.items() if n not in self.names)
        return Rules(out)

    def __add__(self, other: Rules) -> Rules:
        if not isinstance(other, Rules):
            return NotImplemented
        return Rules(self._table + other._table)

    def __iter__(self):
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Rules) and self._table == other._table

    def __hash__(self) -> int:
        return hash(self._table)

    def __repr__(self) -> str:
        return f"Rules({list(self._table)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Rules, (self._table,))


def _check_names(names: Any, path: Any, mesh: Mesh | None) -> Names:
    if isinstance(names, str) or not isinstance(names, Sequence) or isinstance(names, P):
        raise sharding_error(
            f"logical names must be a tuple with one name (or None) per dim, got {type(names).__name__} {names!r}",
            fix="write e.g. ('batch', 'embed'), or ('embed',) for a single dim",
            path=path,
            mesh=mesh,
            cls=TypeError,
        )
    if not all(n is None or isinstance(n, str) for n in names):
        raise sharding_error(
            f"logical names {tuple(names)!r} contain a non-string entry",
            fix="use a str (or None for a replicated dim) per dim",
            path=path,
            mesh=mesh,
            cls=TypeError,
        )
    return tuple(names)


def logical_to_spec(names: Sequence[str | None], rules: Rules, mesh: Mesh, path: Any = None) -> P:
    """Resolve one tensor's logical dim names to a ``P`` for ``mesh``, Flax-style.

    Rules are tried in table order; a rule ``(name, axes)`` goes to the first still-unassigned
    dim called ``name`` if none of ``axes`` is used by another dim already. So for each dim the
    rules for its name are tried in order and the first admissible one wins, and an earlier rule
    in the table beats a later one when two dims compete for an axis. A dim no rule could take
    is replicated. This choice depends only on the names and the table, never on the mesh; then
    mesh axes of size 1 *and axes of a layout preset that the mesh does not have* are dropped from
    the result, so one table serves every mesh (layouts check separately that the axes they need
    exist). An axis neither the mesh nor any preset knows is a typo: an error.

    Args:
        names: one logical name (or ``None``: replicated) per tensor dim.
        rules: the table.
        mesh: the mesh the spec is for.
        path: the tensor's key path, for error messages.

    Returns:
        A ``P`` with one entry per name.

    Raises:
        ShardingError: a name has no rule at all (a typo of a known name gets "did you mean"); a chosen rule
            names a mesh axis that neither ``mesh`` nor any layout preset has.
        TypeError: ``names`` is not a tuple of str/None, or ``rules`` is not a :class:`Rules`.

    >>> rules = Rules([("embed", "fsdp"), ("mlp", "fsdp"), ("mlp", "tp")])
    >>> logical_to_spec(("embed", "mlp"), rules, Mesh(fsdp=2, tp=2))
    P('fsdp', 'tp')
    >>> logical_to_spec(("embed", "mlp"), rules, Mesh(fsdp=4))
    P('fsdp', None)
    """
    names = _check_names(names, path, mesh)
    if not isinstance(rules, Rules):
        raise sharding_error(
            f"expected shardings.Rules, got {type(rules).__name__} {rules!r}",
            fix="wrap the table: Rules([...]) or Rules(batch='dp', ...)",
            path=path,
            mesh=mesh,
            cls=TypeError,
        )
    for name in names:
        if name is not None and not rules.targets(name):
            raise _unknown_name(name, names, rules, mesh, path)
    chosen: list[tuple[str, ...] | None] = [None] * len(names)
    used: set[str] = set()
    for rule_name, target in rules:
        axes = _axes(target)
        for dim, name in enumerate(names):
            if name == rule_name and chosen[dim] is None and used.isdisjoint(axes):
                _check_axes(name, target, mesh, path)
                chosen[dim] = axes
                used.update(axes)
    kept = [tuple(a for a in axes or () if mesh.shape.get(a, 1) > 1) for axes in chosen]
    return P(*(_entry(axes) for axes in kept))


def _unknown_name(name: str, names: Names, rules: Rules, mesh: Mesh, path: Any) -> Exception:
    """A name no rule knows: a typo of a known name (either side: the model's axes or a ``Rules`` table) gets
    "did you mean"; a new name, how to add its rule. The known names are listed, not the whole table."""
    close = difflib.get_close_matches(name, rules.names, n=1, cutoff=0.6)
    if close:
        return sharding_error(
            f"unknown logical name {name!r} (of the names {names}): did you mean {close[0]!r}?",
            fix=f"write {close[0]!r} where the model's axes name {name!r}; or, if the rules table is the one "
            f"misspelled, rename its rule {close[0]!r} to {name!r}",
            path=path,
            mesh=mesh,
        )
    return sharding_error(
        f"unknown logical name {name!r} (of the names {names}): no rule names it; the rules name {list(rules.names)}",
        fix=f"use one of those, or add a rule for it: rules + Rules({name}=None) to replicate it, "
        f"or rules + Rules({name}='<mesh axis>') to shard it",
        path=path,
        mesh=mesh,
    )


def _check_axes(name: str, target: Entry, mesh: Mesh, path: Any) -> None:
    for axis in _axes(target):
        if axis not in mesh.shape and axis not in _PRESET_AXES:
            raise sharding_error(
                f"the rule ({name!r}, {target!r}) names mesh axis {axis!r}, which neither the mesh (axes "
                f"{mesh.axis_names}) nor any layout preset has",
                fix=f"name one of the mesh's axes {mesh.axis_names}, or add {axis!r} to the Mesh",
                path=path,
                mesh=mesh,
            )


def is_names(x: Any) -> bool:
    """Whether ``x`` is one tensor's logical names (a tuple of str/None): the leaves of a names tree."""
    return isinstance(x, tuple) and not isinstance(x, P) and all(n is None or isinstance(n, str) for n in x)


def logical_to_specs(names_tree: Any, rules: Rules, mesh: Mesh) -> Any:
    """Map a tree of logical-name tuples (e.g. ``models.gpt.axes(cfg)``) to a tree of ``P``.

    >>> logical_to_specs({"w": ("embed", "mlp"), "b": ("mlp",)}, Rules(embed=None, mlp="tp"), Mesh(tp=2))
    {'w': P(None, 'tp'), 'b': P('tp')}
    """
    return pytree.map_with_path(lambda p, n: logical_to_spec(n, rules, mesh, path=p), names_tree, is_leaf=is_names)


def _key_str(key: Any) -> str:
    if isinstance(key, torch_pytree.MappingKey):
        return str(key.key)
    if isinstance(key, torch_pytree.SequenceKey):
        return str(key.idx)
    if isinstance(key, torch_pytree.GetAttrKey):
        return key.name
    return str(key)


def path_str(path: pytree.KeyPath) -> str:
    """The readable path :func:`annotate` matches against: keys joined with ``"/"``.

    >>> path_str(pytree.leaves_with_path({"blocks": [{"wq": 0}]})[0][0])
    'blocks/0/wq'
    """
    return "/".join(_key_str(k) for k in path)


def annotate(tree: Any, patterns: Mapping[str, Sequence[str | None]]) -> Any:
    """Name the dims of every leaf of a tree you did not write, by regex over its path.

    Each leaf's path is its keys joined with ``"/"`` (:func:`path_str`): ``"blocks/0/attn/wq"``
    for nested dicts/lists/NamedTuples, and the key itself for a flat dict with dotted keys, such
    as a Hugging Face state dict (``"model.layers.0.self_attn.q_proj.weight"``). A pattern
    applies where ``re.search`` finds it in the path (anchor with ``^``/``$`` as needed). Names
    shorter than the leaf's rank are padded with ``None`` (trailing dims replicated), as in ``P``.

    Args:
        tree: any pytree whose leaves have ``.shape`` (leaves without one count as scalars).
        patterns: path regex → logical names for the leaves it matches.

    Returns:
        A tree of the same structure with a names tuple per leaf (map it with ``is_leaf=is_names``).

    Raises:
        ShardingError: a leaf no pattern matches, or two patterns with different names match;
            names longer than the leaf's rank; a pattern that is not a valid regex.

    >>> sd = {"model.embed_tokens.weight": torch.zeros(8, 4), "model.norm.weight": torch.zeros(4)}
    >>> annotate(sd, {r"embed_tokens": ("vocab", "embed"), r"norm\\.weight$": ("embed",)})
    {'model.embed_tokens.weight': ('vocab', 'embed'), 'model.norm.weight': ('embed',)}
    """
    compiled = []
    for pattern, names in patterns.items():
        try:
            compiled.append((pattern, re.compile(pattern), _check_names(names, None, None)))
        except re.error as e:
            raise sharding_error(
                f"pattern {pattern!r} is not a valid regular expression ({e})", fix="fix the regex"
            ) from None

    def one(path: pytree.KeyPath, leaf: Any) -> Names:
        where = path_str(path)
        hits = [(p, names) for p, rx, names in compiled if rx.search(where)]
        if not hits:
            raise sharding_error(
                f"no pattern matches this leaf's path; patterns: {list(patterns)}",
                fix=f"add a pattern for this leaf, e.g. {'^' + re.escape(where) + '$'!r}",
                path=repr(where),
            )
        if len({names for _, names in hits}) > 1:
            raise sharding_error(
                f"patterns with different names match this leaf's path: {dict(hits)}",
                fix="make the patterns disjoint (anchor them with ^ and $), or give them the same names",
                path=repr(where),
            )
        names = hits[0][1]
        shape = tuple(getattr(leaf, "shape", ()))
        if len(names) > len(shape):
            raise sharding_error(
                f"pattern {hits[0][0]!r} gives {len(names)} names {names} to a leaf with {len(shape)} dims",
                fix="give at most one name per dim",
                path=repr(where),
                shape=shape,
            )
        return names + (None,) * (len(shape) - len(names))

    return pytree.map_with_path(one, tree)
