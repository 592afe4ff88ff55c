"""Each parameter's bytes per rank in every role, and what moves it between roles, from its specs alone.

No tensor is made: the model's init runs deferred (recipes: shapes and dtypes), the layout's rule tables give
each leaf's spec per role (:func:`shardings.step.initialize.param_specs`, as the train step resolves them), and
a rank's block of a ``shape`` under a spec has ``∏ ceil(n / axis size)`` elements (torch's first-rank split).
The blocks of a model repeat with a period (:func:`~shardings.planner.model_profile.block_period`), so one
period's leaves stand for all of them: :class:`Leaves` has the leaves outside the blocks (``edge``) and one
period's (``period``), each with its per-role element counts and the collectives its role transitions take
(:class:`Moves`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch

import core
from core import deferred, tree
from shardings.pipeline.stages import block_index
from shardings.planner.candidates import layout_of
from shardings.spec import layouts, lower
from shardings.spec.mesh import Mesh, P
from shardings.spec.rules import logical_to_spec
from shardings.step import mixed
from shardings.step.initialize import param_specs

__all__ = ["LOOKUP", "Leaf", "Leaves", "keeps_master", "leaves", "on_device", "optimizer_factor"]

_ROLES = ("params", "compute", "grads", "opt_state")
LOOKUP = "vocab"
"""The logical name of a lookup table's rows (an embedding ``(vocab, embed)``). DTensor's embedding backward has no
rule for a table whose rows are sharded (vocab-parallel under ``tp``): its gradient comes back replicated over the
axes that shard the rows, so the data-parallel reduction moves the whole rows (the exact runs count it so; the
slice back to this rank's rows is local)."""


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter: elements a rank holds per role, and the mesh axes its role transitions cross.

    Attributes:
        numel: elements per rank by role (``params`` storage, ``compute``, ``held`` gradient (what the step holds:
            the grads role if reduced in backward or gathered, else compute), ``opt_state`` placement), and
            ``arrives``: the gradient's elements as backward hands it to the data-parallel reduction (the compute
            block, but a lookup table's whole rows: :data:`LOOKUP`).
        itemsize: bytes per element of the parameter (its storage dtype).
        floating: a floating-point parameter (cast by a precision policy).
        gather: axes its storage is split over and its compute is not (ZeRO-3: gathered before use).
        scatter: axes its gradient is reduce-scattered over (into a sharded optimizer state).
        reduce: axes its gradient is all-reduced over (the data axes its optimizer state is replicated on).
        regather: axes its updated storage is all-gathered back over (ZeRO-1/2: stored whole, updated in shards).
        in_blocks: it is a block's parameter (``params["blocks"][i]``): ZeRO-3 re-gathers it in backward.
        in_backward: the DTensor path reduces its gradient in backward (gathered: its gather's backward; grads role
            sharded where its storage is not: ``shardings.step.dtensor_path.reduce_in_backward``), not after it.
    """

    numel: dict[str, int]
    itemsize: int
    floating: bool
    gather: tuple[str, ...]
    scatter: tuple[str, ...]
    reduce: tuple[str, ...]
    regather: tuple[str, ...]
    in_blocks: bool
    in_backward: bool = False


@dataclasses.dataclass(frozen=True)
class Leaves:
    """The leaves outside the blocks and those of one period of blocks, on one (stage) mesh.

    Attributes:
        edge: the leaves outside the blocks.
        period: one period's leaves.
        period_blocks: blocks in a period.
        mesh: the (stage) mesh.
        placements: per role (``params``, ``opt_state``) each leaf's placements, edge then period leaves in tree
            order: what the step's own decisions read (:func:`keeps_master`).
        dtypes: each leaf's storage dtype, in the same order.
    """

    edge: tuple[Leaf, ...]
    period: tuple[Leaf, ...]
    period_blocks: int
    mesh: Mesh | None = None
    placements: dict[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)
    dtypes: tuple[torch.dtype, ...] = ()


def keeps_master(leaves: Leaves, compute: torch.dtype | None) -> bool:
    """Whether the step keeps fp32 master weights in the optimizer state (ZeRO-1/2 under a policy): the step's own
    :func:`shardings.step.mixed.keeps_master`, asked about these leaves (shape-less meta stand-ins of their dtypes)."""
    params = [torch.empty(0, dtype=d, device="meta") for d in leaves.dtypes]
    return mixed.keeps_master(mixed.Cast(compute), params, leaves.placements, leaves.mesh)


def _local(shape: tuple[int, ...], spec: P, mesh: Mesh) -> int:
    dims = spec.dim_axes() + ((),) * len(shape)
    return math.prod(-(-n // mesh.axis_size(a)) for n, a in zip(shape, dims))


def _axes(spec: P) -> set[str]:
    return set(spec.axes)


def leaves(model: Any, cfg: Any, layout: str, sizes: tuple[tuple[str, int], ...], period: int) -> Leaves:
    """Per-role elements and transitions of every leaf, for ``cfg`` with ``period`` blocks, under ``layout`` on
    the mesh ``sizes`` (a pipelined layout's stage mesh: ``pp`` left out).

    Cached by signature: the offload presets move roles to the host without changing any spec, so a layout and
    its offloaded variants share one entry (:func:`on_device`)."""
    return _leaves(model, cfg, on_device(layout), sizes, period)


@functools.lru_cache(maxsize=4096)
def on_device(layout: str) -> str:
    """``layout`` without its offload presets (those that only set ``Layout.host``): the same specs per role."""
    kept = [p for p in layout_of(layout).presets if not layouts.preset(p).layout.host]
    return "+".join(kept) if kept else layout


@functools.lru_cache(maxsize=64)
def _recipes(model: Any, small: Any) -> tuple[Any, Any]:
    with deferred.deferred():  # shapes and dtypes only: nothing is drawn
        return model.init(core.random.key(0), small), model.axes(small)


@functools.lru_cache(maxsize=4096)
def _leaves(model: Any, cfg: Any, layout: str, sizes: tuple[tuple[str, int], ...], period: int) -> Leaves:
    layout_ = layout_of(layout)
    mesh = Mesh(dict(sizes))
    recipes, axes = _recipes(model, dataclasses.replace(cfg, layers=period))
    names = dict(tree.leaves_with_path(axes, is_leaf=lambda n: isinstance(n, tuple)))
    specs = {r: tree.leaves(param_specs(axes, recipes, layout_, mesh, role=r), is_leaf=lambda s: isinstance(s, P))
             for r in _ROLES}
    batch = logical_to_spec(("batch", "seq"), layout_.role("batch"), mesh)
    data = [a for a in batch.axes if mesh.axis_size(a) > 1]
    edge, block, order = [], [], {"edge": [], "period": []}
    for i, (path, recipe) in enumerate(tree.leaves_with_path(recipes)):
        shape = tuple(recipe.shape)
        s, c, g, o = (specs[r][i] for r in _ROLES)
        gathered = s != c
        reduce_now = g != c and not gathered
        numel = {"params": _local(shape, s, mesh), "compute": _local(shape, c, mesh),
                 "held": _local(shape, g if reduce_now or gathered else c, mesh), "opt_state": _local(shape, o, mesh)}
        rows = c.dim_axes()[0] if shape and names.get(path, ())[:1] == (LOOKUP,) else ()
        numel["arrives"] = numel["compute"] * math.prod(mesh.axis_size(a) for a in rows)
        partial = [a for a in data if a not in _axes(c)]  # gradients come out summed over nothing else
        scatter = tuple(a for a in partial if a in _axes(o))
        leaf = Leaf(numel, recipe.dtype.itemsize, recipe.dtype.is_floating_point,
                    tuple(a for a in _axes(s) - _axes(c) if mesh.axis_size(a) > 1), scatter,
                    tuple(a for a in partial if a not in scatter),
                    tuple(a for a in _axes(o) - _axes(s) if a in data) if not gathered else (),
                    block_index(path) is not None, reduce_now or gathered)
        (block if leaf.in_blocks else edge).append(leaf)
        order["period" if leaf.in_blocks else "edge"].append((recipe.dtype, {
            r: lower.to_placements(specs[r][i], mesh, len(shape)) for r in ("params", "opt_state")}))
    placed = order["edge"] + order["period"]
    return Leaves(tuple(edge), tuple(block), period, mesh,
                  {r: tuple(p[r] for _, p in placed) for r in ("params", "opt_state")}, tuple(d for d, _ in placed))


@functools.lru_cache(maxsize=64)
def optimizer_factor(optimizer: Any) -> float:
    """Elements of optimizer state per parameter element (AdamW: 2), from its ``init`` on a meta tensor."""
    state = optimizer.init({"w": torch.empty(1024, device="meta")})
    return sum(x.numel() for x in tree.leaves(state) if isinstance(x, torch.Tensor) and x.numel() > 1) / 1024

