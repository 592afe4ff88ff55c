"""Does a layout compute what one device computes? Loss, grads and params, step by step."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

import core
from core import tree
from shardings.distribute import gather
from shardings.initialize import init as sharded_init
from shardings.layouts import get as get_layout
from shardings.mesh import Mesh
from shardings.simulate import per_rank, simulate
from shardings.train_step import train_step

__all__ = ["EquivalenceError", "Report", "Row", "Tolerance", "check_equivalence", "compare_trees"]


class EquivalenceError(AssertionError):
    """A layout's loss, grads or params differ from the single-device reference past tolerance."""


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """``|a - b| <= atol + rtol·|b|`` elementwise (DESIGN §5 defaults for fp32)."""

    rtol: float
    atol: float


LOSS_TOL = Tolerance(rtol=1e-5, atol=0.0)
TREE_TOL = Tolerance(rtol=1e-4, atol=1e-5)


@dataclasses.dataclass(frozen=True)
class Row:
    """One comparison: a quantity of one layout at one step."""

    layout: str
    step: int
    quantity: str  # "loss" | "grads" | "params"
    max_abs: float
    max_rel: float
    worst_path: str
    ok: bool


@dataclasses.dataclass
class Report:
    """Every comparison made by :func:`check_equivalence`."""

    rows: list[Row]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    def worst(self) -> Row:
        """The failing row with the largest excess (or the largest difference when all pass)."""
        bad = [r for r in self.rows if not r.ok] or self.rows
        return max(bad, key=lambda r: r.max_abs)

    def table(self) -> str:
        """A text table: layout, step, quantity, max abs/rel difference, worst key path, verdict."""
        head = f"{'layout':<18} {'step':>4} {'quantity':<8} {'max_abs':>10} {'max_rel':>10}  {'':4} worst path"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            lines.append(f"{r.layout:<18} {r.step:>4} {r.quantity:<8} {r.max_abs:>10.3e} {r.max_rel:>10.3e}  "
                         f"{'ok' if r.ok else 'FAIL':4} {r.worst_path}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _diff(a: torch.Tensor, b: torch.Tensor, tol: Tolerance) -> tuple[float, float, bool]:
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf"), float("inf"), False
    err = (a - b).abs()
    rel = err / b.abs().clamp_min(1e-12)
    ok = bool((err <= tol.atol + tol.rtol * b.abs()).all())
    return (float(err.max()) if err.numel() else 0.0), (float(rel.max()) if rel.numel() else 0.0), ok


def compare_trees(got: Any, want: Any, tol: Tolerance) -> tuple[float, float, str, bool]:
    """Max abs/rel difference over matching leaves, the worst leaf's key path, and whether all pass."""
    worst = (0.0, 0.0, "", True)
    want_leaves = dict((tree.keystr(p), x) for p, x in tree.leaves_with_path(want))
    for path, g in tree.leaves_with_path(got):
        key = tree.keystr(path)
        abs_, rel, ok = _diff(g, want_leaves[key], tol)
        if (not ok and worst[3]) or (ok == worst[3] and abs_ > worst[0]):
            worst = (abs_, rel, key, ok)
    return worst


def _reference(init, loss_fn, cfg, batch, optimizer, steps, key, clip_norm):
    params = init(key, cfg)
    opt = core.optim.chain(core.optim.clip_by_global_norm(clip_norm), optimizer) if clip_norm else optimizer
    state = opt.init(params)
    out = []
    for _ in range(steps):
        loss, grads = core.value_and_grad(loss_fn)(params, batch)
        updates, state = opt.update(grads, state, params)
        params = core.optim.apply_updates(params, updates)
        out.append((loss, grads, params))
    return out


def _rank_values(full_tree: Any) -> list[Any]:
    """One plain tree per rank (ranks must each hold the same full values)."""
    leaves, treedef = tree.flatten(full_tree)
    per = [per_rank(x) for x in leaves]  # copies: a donating step writes the next step into these buffers
    return [tree.unflatten(treedef, [p[r].clone() for p in per]) for r in range(len(per[0]))]


def _sharded_run(init, loss_fn, axes, cfg, batch, optimizer, steps, key, layout, mesh, step_kw):
    """Per step, one ``{"loss", "grads", "params"}`` tree of full values per rank this process holds."""
    optimizer = optimizer() if not isinstance(optimizer, core.optim.GradientTransformation) else optimizer
    params = sharded_init(init, key, cfg, axes=axes, layout=layout, mesh=mesh)
    step = train_step(loss_fn, optimizer, layout=layout, mesh=mesh, axes=axes, **step_kw)
    state = step.init(params)
    out = []
    for _ in range(steps):
        loss, grads, _ = step.grads(params, batch)
        params, state = step.apply(params, state, grads)
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        out.append(_rank_values({"loss": loss, "grads": gather(grads), "params": gather(params)}))
    return out


def _worker(*args: Any) -> list[Any]:
    # One real rank: its own full copies of loss/grads/params per step (plain CPU tensors).
    return [ranks[0] for ranks in _sharded_run(*args)]


def _run_layout(runtime, init, loss_fn, axes, cfg, batch, optimizer, steps, key, layout, mesh, step_kw):
    args = (init, loss_fn, axes, cfg, batch, optimizer, steps, key, layout, mesh, step_kw)
    if runtime == "simulate":
        with simulate(mesh.size):
            return _sharded_run(*args)
    if runtime != "multiprocess":
        raise ValueError(f"check_equivalence: runtime must be 'simulate' or 'multiprocess', got {runtime!r}")
    if isinstance(optimizer, core.optim.GradientTransformation):
        raise TypeError(
            "check_equivalence(runtime='multiprocess') sends the optimizer to other processes, and a "
            "GradientTransformation holds closures that cannot be pickled. Fix: pass a factory, e.g. "
            "optimizer=functools.partial(core.optim.adamw, 1e-3)."
        )
    from shardings.launch import launch

    per_rank_steps = launch(_worker, mesh.size, *args)
    return [list(step) for step in zip(*per_rank_steps)]


def check_equivalence(
    init: Callable[[Any, Any], Any],
    loss: Callable[..., torch.Tensor],
    axes: Any,
    cfg: Any,
    batch: Any,
    *,
    layouts: Sequence[Any],
    mesh: Mesh,
    steps: int = 3,
    optimizer: Any = None,
    accum_steps: int = 1,
    clip_norm: float | None = None,
    seed: int = 0,
    loss_tol: Tolerance = LOSS_TOL,
    tree_tol: Tolerance = TREE_TOL,
    raise_on_failure: bool = True,
    runtime: str = "simulate",
    local: bool = True,
    donate: bool = False,
) -> Report:
    """Run each layout on simulated ranks and compare with the single-device reference, every step.

    Every rank's copy of loss, gathered grads and gathered params is compared (a rank-dependent
    bug cannot hide behind rank 0).

    Args:
        init: ``init(key, cfg) -> params`` (single-device, ``core.random``).
        loss: ``loss(params, batch, cfg=cfg)``.
        axes: the params' logical names, or ``axes(cfg)`` as a function.
        cfg: the model config.
        batch: a full (global) batch of plain tensors.
        layouts: layouts or preset strings to check.
        mesh: the mesh (simulated with ``mesh.size`` ranks).
        steps: optimizer steps.
        optimizer: a ``core.optim`` transformation, or a picklable factory of one (needed for
            ``runtime="multiprocess"``; default ``functools.partial(core.optim.adamw, 1e-3)``).
        accum_steps: microbatches per step on the sharded side (the reference takes the whole batch).
        clip_norm: global-norm clipping on both sides.
        seed: the init key's seed.
        loss_tol, tree_tol: tolerances (DESIGN §5 defaults).
        raise_on_failure: raise :class:`EquivalenceError` when any comparison fails.
        runtime: ``"simulate"`` (ranks in this process) or ``"multiprocess"`` (real processes via
            ``shardings.launch``, gloo on CPU; every function and config passed must be picklable).
        local: the train step's ``local`` option: data-parallel layouts run the loss on local
            tensors (``shardings.local_step``); ``False`` checks the all-DTensor path.
        donate: the train step's ``donate`` option (AdamW's fused kernel in place on local shards).

    Returns:
        A :class:`Report` (``print(report)`` shows the table).

    >>> report = check_equivalence(models.gpt.init, models.gpt.loss, models.gpt.axes, cfg, batch,
    ...                            layouts=["dp", "zero3+tp"], mesh=Mesh(dp=2, tp=2))
    """
    optimizer = optimizer if optimizer is not None else functools.partial(core.optim.adamw, 1e-3)
    axes = axes(cfg) if callable(axes) else axes
    loss_fn = functools.partial(loss, cfg=cfg)
    key = core.random.key(seed)
    make = optimizer if not isinstance(optimizer, core.optim.GradientTransformation) else (lambda: optimizer)
    ref = _reference(init, loss_fn, cfg, batch, make(), steps, key, clip_norm)
    rows: list[Row] = []
    for layout in layouts:
        layout = get_layout(layout)
        step_kw = dict(accum_steps=accum_steps, clip_norm=clip_norm, local=local, donate=donate)
        got = _run_layout(runtime, init, loss_fn, axes, cfg, batch, optimizer, steps, key, layout, mesh, step_kw)
        for i, ((ref_loss, ref_grads, ref_params), per_ranks) in enumerate(zip(ref, got)):
            for quantity, want, tol in (("loss", ref_loss, loss_tol), ("grads", ref_grads, tree_tol),
                                        ("params", ref_params, tree_tol)):
                results = [compare_trees(r[quantity], want, tol) for r in per_ranks]
                abs_, rel, path, ok = max(results, key=lambda r: (not r[3], r[0]))
                rows.append(Row(layout.name, i + 1, quantity, abs_, rel, path or "<scalar>", ok))
    report = Report(rows)
    if raise_on_failure and not report.ok:
        w = report.worst()
        raise EquivalenceError(
            f"layout {w.layout!r} on {mesh!r}: {w.quantity} differ from the single-device reference at step {w.step}, "
            f"worst at {w.worst_path} (max abs {w.max_abs:.3e}, max rel {w.max_rel:.3e}).\n{report.table()}"
        )
    return report
