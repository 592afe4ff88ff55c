"""A whole step at a glance: how a layout splits each parameter group in each role, and what it sends.

``describe(params, axes, layout, mesh)`` resolves every parameter's logical names with the
layout's rule tables for the four roles a parameter plays — storage between steps, compute while
the loss runs, reduced gradients, optimizer state — and groups the leaves that share a name path
up to list indices (``blocks[0-3].wq``), shape and specs. Given the ``comms()`` record of one
step it adds the collectives by kind × mesh axis with bytes per rank. ``print(view)`` shows it as
text; ``view.to_dict()`` is what ``experiments.report`` draws as ``layout.png``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from core import tree
from shardings.pipeline.plan import Plan, plan_for
from shardings.spec import layouts
from shardings.spec.layouts import PARAM_ROLES, Layout
from shardings.spec.mesh import Mesh, P
from shardings.spec.rules import is_names, logical_to_spec

__all__ = ["GroupRow", "LayoutView", "describe", "rules_table"]
_TITLES = {"params": "storage", "compute": "compute", "grads": "grads", "opt_state": "opt state"}


@dataclasses.dataclass(frozen=True)
class GroupRow:
    """Parameters of one group: their shape, and per role the spec and the share of the tensor a rank holds."""

    group: str
    shape: tuple[int, ...]
    count: int
    specs: dict[str, P]
    shares: dict[str, float]
    pp_rank: int | None = None  # under pp: the pipeline rank holding these blocks; None: every rank (or no pp)


@dataclasses.dataclass(frozen=True)
class LayoutView:
    """The layout's effect on every parameter group, and (optionally) a step's collectives."""

    layout: str
    mesh: Mesh
    rows: list[GroupRow]
    comm: list[dict[str, Any]]
    pipelined: bool = False  # the layout pipelines the blocks: each row says which pp rank holds it

    def text(self) -> str:
        """The view as a text table: one line per parameter group (under pp, with the pp rank holding it), then the
        collectives."""
        cells = [[r.group, str(r.shape)] + [_cell(r.specs[k], r.shares[k]) for k in PARAM_ROLES]
                 + ([_pp_cell(r.pp_rank)] if self.pipelined else []) for r in self.rows]
        head = ["param", "shape"] + [_TITLES[k] for k in PARAM_ROLES] + (["pp rank"] if self.pipelined else [])
        widths = [max(len(row[i]) for row in [head, *cells]) for i in range(len(head))]
        line = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
        out = [f"layout {self.layout!r} on {self.mesh!r} ({self.mesh.size} ranks): spec and share each rank holds",
               line(head), line(["-" * w for w in widths]), *map(line, cells)]
        if self.comm:
            out += ["", "collectives per step (bytes sent per rank)"]
            out += [f"{'kind':<16}{'axis':<12}{'count':>6}{'bytes':>14}"]
            out += [f"{c['kind']:<16}{c['axis']:<12}{c['count']:>6}{c['bytes']:>14,}" for c in self.comm]
        return "\n".join(out)

    def __str__(self) -> str:
        return self.text()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: layout, mesh sizes, rows (specs as lists) and comm rows."""
        return {
            "layout": self.layout,
            "mesh": self.mesh.shape,
            "rows": [{"group": r.group, "shape": list(r.shape), "count": r.count,
                      "specs": {k: [list(e) if isinstance(e, tuple) else e for e in s] for k, s in r.specs.items()},
                      "shares": r.shares, **({"pp_rank": r.pp_rank} if self.pipelined else {})}
                     for r in self.rows],
            "comm": self.comm,
            "pipelined": self.pipelined,
        }


def _pp_cell(rank: int | None) -> str:
    return "all" if rank is None else str(rank)


def _cell(spec: P, share: float) -> str:
    return f"{spec!r} {'all' if share == 1 else f'1/{round(1 / share)}'}"


def _group_of(path: str) -> tuple[str, tuple[int, ...]]:
    """``"['blocks'][3]['wq']"`` -> ``("blocks[*].wq", (3,))``: the path with list indices taken out."""
    indices = tuple(int(i) for i in re.findall(r"\[(\d+)\]", path))
    name = re.sub(r"\[(\d+)\]", "[*]", path)
    name = re.sub(r"\['([^']*)'\]", r".\1", name).lstrip(".")
    return name, indices


def _label(name: str, indices: list[tuple[int, ...]]) -> str:
    """``blocks[*].wq`` with indices 0..3 -> ``blocks[0-3].wq`` (or ``[0,2]`` when not a run)."""
    if not indices or not indices[0]:
        return name
    firsts = sorted({i[0] for i in indices})
    runs = firsts == list(range(firsts[0], firsts[-1] + 1)) and len(firsts) > 2
    text = f"{firsts[0]}-{firsts[-1]}" if runs else ",".join(map(str, firsts))
    return name.replace("[*]", f"[{text}]", 1)


def describe(params: Any, axes: Any, layout: str | Layout, mesh: Mesh, comm: Any = None,
             plan: Plan | None = None) -> LayoutView:
    """Resolve every parameter's specs under ``layout`` on ``mesh``, grouped, with a step's collectives.

    Under ``pp`` each block group also says which pipeline rank holds it (the pipeline plan's
    :meth:`~shardings.pipeline.Plan.owner`; the parameters outside the blocks are on every pp rank).

    Args:
        params: the parameter tree (plain tensors, DTensors, or anything with ``.shape``).
        axes: the logical names of each parameter dim, same structure as ``params``.
        layout: a preset/composition string or a :class:`~shardings.spec.layouts.Layout`.
        mesh: the mesh (no process group needed: specs are resolved, nothing is placed).
        comm: a ``shardings.comms()`` record of one step, or its ``rows()``, to list the collectives.
        plan: under ``pp``, the run's pipeline plan (default: ``shardings.pipeline.plan``'s for ``params``).

    Returns:
        A :class:`LayoutView` (``print`` it).

    >>> view = describe({"w": torch.zeros(8, 4)}, {"w": ("embed", "mlp")}, "zero3+tp", Mesh(dp=2, tp=2))
    >>> print(view.rows[0].specs["params"], view.rows[0].specs["compute"])
    P('dp', 'tp') P(None, 'tp')
    """
    layout = layouts.get(layout)
    plan = plan_for(layout, mesh, params, plan)  # None without pp
    names = dict((tree.keystr(p), n) for p, n in tree.leaves_with_path(axes, is_leaf=is_names))
    groups: dict[tuple, list[tuple[int, ...]]] = {}
    for path, x in tree.leaves_with_path(params):
        key = tree.keystr(path)
        if key not in names:
            raise ValueError(f"describe: no logical names for the parameter at {key}. Fix: give axes the "
                             f"same tree structure as params (e.g. models.gpt.axes(cfg)).")
        specs = tuple(logical_to_spec(names[key], layout.role(role), mesh, path=key) for role in PARAM_ROLES)
        name, indices = _group_of(key)
        held = plan.owner(indices[0]) if plan is not None and key.startswith(f"['{plan.blocks}'][") else None
        groups.setdefault((name, tuple(x.shape), specs, held), []).append(indices)
    rows = []
    for (name, shape, specs, held), indices in groups.items():
        shares = {role: 1 / mesh.axis_size(tuple(a for e in s for a in ((e,) if isinstance(e, str) else e or ())))
                  for role, s in zip(PARAM_ROLES, specs)}
        rows.append(GroupRow(_label(name, indices), shape, len(indices), dict(zip(PARAM_ROLES, specs)), shares,
                             held))
    comm_rows = comm.rows() if hasattr(comm, "rows") else list(comm or [])
    return LayoutView(layout.name or repr(layout), mesh, rows, comm_rows, plan is not None)


_ROLE_LETTERS = {"params": "S", "compute": "C", "grads": "G", "opt_state": "O", "batch": "B", "activations": "A"}


def _target_text(targets: tuple[Any, ...]) -> str:
    entry = lambda t: "·" if t is None else t if isinstance(t, str) else "(" + ",".join(t) + ")"
    return " | ".join(entry(t) for t in targets)


def rules_table(presets: tuple[str, ...] | None = None) -> str:
    """A markdown table of the logical names every preset maps, generated from the rule tables.

    Rows are logical names, columns presets; a cell lists, per group of roles (S storage, C compute,
    G grads, O optimizer state, B batch, A activations), the mesh axes the name goes to — ``a | b``
    when ``b`` is the fallback taken if another dim of the tensor already holds ``a``. Empty: the
    preset leaves the name alone (replicated, unless another preset of the composition maps it); every
    logical name the models use has a row, so one no preset maps (``head_dim``) shows as never split.

    >>> print(rules_table(("dp",)).splitlines()[2])
    | `batch` | BA→(dp,fsdp) |
    """
    tables = {p: layouts.preset(p).layout for p in layouts.names(aliases=False)}  # in registration order
    # presets without rules (offload_*: they move a role to host memory, not a name to an axis) have no column
    presets = presets or tuple(p for p, t in tables.items() if any(getattr(t, r).names for r in _ROLE_LETTERS))
    names = list(dict.fromkeys(n for p in presets for role in _ROLE_LETTERS for n in getattr(tables[p], role).names))
    # every logical name has a row (one no preset maps: an empty row), then the presets' own names
    names = [*layouts.LOGICAL_NAMES, *(n for n in names if n not in layouts.LOGICAL_NAMES)]
    lines = ["| name | " + " | ".join(f"`{p}`" for p in presets) + " |", "|---|" + "---|" * len(presets)]
    for name in names:
        cells = []
        for p in presets:
            by_target: dict[str, str] = {}
            for role, letter in _ROLE_LETTERS.items():
                targets = getattr(tables[p], role).targets(name)
                if targets:
                    text = _target_text(targets)
                    by_target[text] = by_target.get(text, "") + letter
            cells.append("; ".join(f"{letters}→{t}" for t, letters in by_target.items()))
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)
