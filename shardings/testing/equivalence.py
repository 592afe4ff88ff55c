"""Does a layout compute what one device computes? Loss, grads and params, step by step."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

import core
from core import deferred, tree
from shardings.comm.buckets import DEFAULT_BUCKET_MB
from shardings.pipeline import plan as pipeline_plan
from shardings.spec.layouts import get as get_layout
from shardings.spec.mesh import Mesh
from shardings.step.compiled import DEFAULT_JIT_BACKEND
from shardings.testing.power import Judge, Limit, detection_limit, summarize, unknown_patterns
from shardings.testing.reference import low_dtype, reference_steps
from shardings.testing.report import Report, Row
from shardings.testing.sharded_runs import StagesOf, runners
from shardings.testing.tolerance import LOW_PRECISION_ULPS, ULPS

__all__ = ["EquivalenceError", "Limit", "Planned", "Report", "Row", "check_equivalence", "check_runs", "compare_trees",
           "judge", "plan"]


class EquivalenceError(AssertionError):
    """A layout's loss, grads or params differ from the single-device reference past tolerance."""


def compare_trees(got: Any, want: Any, *, terms: int = 1, ulps: float = ULPS,
                  slack: dict[str, torch.Tensor] | None = None, dtype: torch.dtype | None = None,
                  tolerances: dict[str, float] | None = None,
                  exclude: Sequence[str] = ()) -> tuple[float, float, float, str, bool]:
    """Compare two trees leaf by leaf with the tolerance rule (:mod:`shardings.testing.tolerance`).

    The structures must match: a leaf missing on either side (or an extra one) fails, named by its path.
    Each leaf gets the floor of ``want``'s largest magnitude (a leaf whose truth is 0 is judged by the
    rounding of the tree's values). ``slack`` maps a leaf's key path to a per-element allowance added to the
    rule (:func:`diff`'s); ``tolerances`` maps key-path regexes to the ``ulps`` of the leaves they match, and
    the leaves ``exclude``'s regexes match are not compared (:class:`shardings.testing.power.Judge`).

    Returns:
        ``(max_abs, rel_norm, used, worst_path, ok)`` of the worst leaf (the one using the most of its
        allowed difference).
    """
    return _compare(got, Judge(want, terms=terms, ulps=ulps, dtype=dtype, slack=slack, tolerances=tolerances,
                               exclude=exclude))


def _compare(got: Any, judge: Judge) -> tuple[float, float, float, str, bool]:
    got_leaves = {tree.keystr(p): x for p, x in tree.leaves_with_path(got)}
    missing = sorted(set(got_leaves) ^ (set(judge.want) | set(judge.excluded)))
    if missing:
        return math.inf, math.inf, math.inf, f"{missing[0]} (tree structures differ)", False
    worst = (0.0, 0.0, 0.0, "", True)
    for key in judge.want:
        d = judge.leaf(key, got_leaves[key])
        if d.used >= worst[2]:
            worst = (d.max_abs, d.rel_norm, d.used, key, d.ok)
    return worst


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
    terms: int | None = None,
    ulps: float | None = None,
    raise_on_failure: bool = True,
    runtime: str = "simulate",
    local: bool = True,
    donate: bool = False,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    stages: Callable[[Any], Any] | None = None,
    schedule: Any = None,
    precision: Any = None,
    fp32_twin: bool = True,
    tolerances: dict[str, float] | None = None,
    exclude: Sequence[str] = (),
    jit: bool = False,
    jit_backend: str = DEFAULT_JIT_BACKEND,
    seq_chunks: int = 1,
    chunk_sizes: Any = "terapipe",
) -> Report:
    """Run each layout on simulated ranks and compare with the single-device reference, every step.

    Every rank's copy of loss, gathered grads and gathered params is compared (a rank-dependent
    bug cannot hide behind rank 0), every step, leaf by leaf, with the tolerance rule of
    :mod:`shardings.testing.tolerance` (``terms`` = the batch's tokens by default); the tree
    structures must match. A leaf whose reference is ~0 (a key bias's gradient) is judged on its tree's
    floor, the rounding of the tree's largest values. Params get one more allowance: how far the optimizer moves
    them when the reference's gradients are off by what the rule allows (measured by two extra reference runs,
    :func:`~shardings.testing.reference.reference_steps`) — Adam turns a gradient that is exactly zero on one device
    and 1e-12 on sharded ranks into a learning-rate step, which is rounding, not a bug. From step 2 on, loss and
    grads get the same kind of allowance: how far they move at the params those extra runs reached (params within
    the allowance give gradients that differ by more than one step's rounding).
    A wrong gradient still fails in the grads rows, and a wrong update fails in the params rows.

    Under a bf16/fp16 ``precision`` each layout also runs as its *fp32 twin* (reported as ``<layout>@fp32``):
    the same policy with ``compute_dtype`` float32 (same storage, casts, gathers and reduce dtype), against the
    reference under that policy, by the rule of the twin's coarsest dtype — fp32's when the reduce dtype is
    fp32 (``Policy.bf16_mixed()``, ``fp16_mixed()``), so the layout is checked at fp32 power; the reduce
    dtype's low-precision rule when it is itself bf16/fp16 (the gradients are rounded to it before they are
    summed, on both sides). Every run's report states its detection limits (:class:`Report`).

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
        terms: the reduction length behind the compared values, for the tolerance rule
            (:func:`shardings.testing.tolerance`); default the number of elements of the batch's
            largest leaf (the tokens a loss and its gradients sum over); 1 under a bf16/fp16 ``precision``.
        ulps: the rule's margin (default :data:`shardings.testing.ULPS`; under a bf16/fp16 ``precision``
            :data:`~shardings.testing.tolerance.LOW_PRECISION_ULPS`).
        raise_on_failure: raise :class:`EquivalenceError` when any comparison fails.
        runtime: ``"simulate"`` (ranks in this process) or ``"multiprocess"`` (real processes via
            ``shardings.launch``, gloo on CPU; every function and config passed must be picklable).
        local: the train step's ``local`` option: data-parallel layouts run the loss on local
            tensors (``shardings.step.local_step``); ``False`` checks the all-DTensor path.
        donate: the train step's ``donate`` option (AdamW's fused kernel in place on local shards).
        bucket_mb: the train step's bucket size for its flattened collectives: a small one checks
            several buckets (their boundaries, overlap and ZeRO-3 prefetch) on a small model.
        stages: for layouts with ``pp``: the model's stage declaration as a function of ``cfg``
            (``models.gpt.stages``); the pipeline then runs ``accum_steps`` microbatches (default ``pp``).
        schedule: for layouts with ``pp``: a name from ``shardings.pipeline.SCHEDULES`` (default
            ``shardings.pipeline.DEFAULT_SCHEDULE``) or a ``shardings.pipeline.Schedule``; the pipeline plan
            (``shardings.pipeline.plan``) is made from it, ``accum_steps`` and the model's shapes.
        seq_chunks, chunk_sizes: for layouts with ``pp``: TeraPipe's chunks per sequence and their sizes
            (``shardings.pipeline.plan``'s); the reference still runs whole sequences.
        precision: a ``core.precision.Policy`` for both sides: the reference runs the same policy on one device
            (params cast to compute dtype, gradients rounded to reduce dtype, the same initial loss scale), and
            the tolerance rule uses the compute dtype's epsilon (:func:`check_runs`).
        fp32_twin: under a bf16/fp16 ``precision``, also run each layout's fp32 twin (above).
        tolerances: key-path regex -> ulps, for the leaves it matches (``re.search`` on the path as the report
            prints it: ``{"'bk'": 256}`` for every ``['blocks'][i]['bk']``); the first match wins. Reported.
        exclude: key-path regexes of leaves left out of every comparison (reported in the table).
        jit: the train step's ``jit`` option (``torch.compile``, per block when ``stages`` is given); needs
            ``runtime="multiprocess"`` (simulated ranks cannot be compiled: the step says so). A layout whose step
            would run eagerly instead (its ``CompileFallbackWarning``) fails: the check would not check the compiled
            step. :func:`shardings.testing.check_equivalences` runs many such checks in one launch.
        jit_backend: the train step's ``jit_backend`` (``"aot_eager"``: the same graphs, compiled quickly).

    With ``runtime="multiprocess"`` one set of real ranks runs every layout in turn (one launch).

    Returns:
        A :class:`Report` (``print(report)`` shows the table).

    Raises:
        EquivalenceError: a comparison failed (with ``raise_on_failure``).
        ValueError: a ``tolerances`` or ``exclude`` pattern that matches no leaf.

    >>> report = check_equivalence(models.gpt.init, models.gpt.loss, models.gpt.axes, cfg, batch,
    ...                            layouts=["dp", "zero3+tp"], mesh=Mesh(dp=2, tp=2))
    """
    planned = plan(**{name: value for name, value in locals().items() if name not in ("raise_on_failure", "runtime")})
    report = judge(planned, runners(runtime, planned.jobs()))
    return raise_if_failed(report, f" on {mesh!r}") if raise_on_failure else report


@dataclasses.dataclass(frozen=True)
class Planned:
    """One :func:`check_equivalence` call before it runs: per precision policy, its sharded runs (run name ->
    the arguments of one layout's run, ``shardings.testing.sharded_runs``), and how :func:`check_runs` judges them."""

    groups: list[tuple[Any, dict[str, tuple]]]  # (policy, {run name: job}): the policy's run and its fp32 twin's
    judging: dict[str, Any]  # check_runs' arguments besides the runs and the policy

    def jobs(self) -> dict[str, tuple]:
        return {name: job for _, jobs in self.groups for name, job in jobs.items()}


def plan(init, loss, axes, cfg, batch, *, layouts, mesh, steps, optimizer, accum_steps, clip_norm, seed, terms, ulps,
         local, donate, bucket_mb, stages, schedule, precision, fp32_twin, tolerances, exclude, jit,
         jit_backend, seq_chunks=1, chunk_sizes="terapipe") -> Planned:
    """:func:`check_equivalence`'s runs, not run yet (its arguments, less ``runtime`` and ``raise_on_failure``)."""
    optimizer = optimizer if optimizer is not None else functools.partial(core.optim.adamw, 1e-3)
    axes = axes(cfg) if callable(axes) else axes
    loss_fn = functools.partial(loss, cfg=cfg)
    key = core.random.key(seed)
    policies = [("", precision)]
    if fp32_twin and _is_low(precision):
        policies.append(("@fp32", dataclasses.replace(precision, compute_dtype=torch.float32)))
    groups = []
    for suffix, policy in policies:
        jobs = {}
        for layout in layouts:
            layout = get_layout(layout)
            step_kw = dict(accum_steps=accum_steps, clip_norm=clip_norm, local=local, donate=donate,
                           bucket_mb=bucket_mb, precision=policy)
            if jit:
                step_kw.update(jit=True, jit_backend=jit_backend)
            layout_loss = StagesOf(stages, cfg) if jit and stages is not None else loss_fn  # jit: a graph per block
            if layout.pipelined:
                if stages is None:
                    raise ValueError(f"check_equivalence: layout {layout.name!r} pipelines the blocks. Fix: pass "
                                     "stages=model.stages (a function of cfg), e.g. stages=models.gpt.stages.")
                with deferred.deferred():  # shapes only: what the pipeline plan's split balances
                    shapes = init(key, cfg)
                layout_loss, step_kw["plan"] = StagesOf(stages, cfg), pipeline_plan(
                    layout, mesh, shapes, schedule=schedule, accum_steps=accum_steps, blocks=stages(cfg).blocks,
                    seq_chunks=seq_chunks, chunk_sizes=chunk_sizes)
            jobs[layout.name + suffix] = (init, layout_loss, axes, cfg, batch, optimizer, steps, key, layout, mesh,
                                          step_kw)
        groups.append((policy, jobs))
    judging = dict(init=init, loss=loss, cfg=cfg, batch=batch, steps=steps, optimizer=optimizer, clip_norm=clip_norm,
                   seed=seed, terms=terms, ulps=ulps, tolerances=tolerances, exclude=exclude)
    return Planned(groups, judging)


def judge(planned: Planned, runs: dict[str, Callable[[], list[list[Any]]]]) -> Report:
    """The report of a planned check, its runs given by name (:func:`check_runs` per policy; never raises)."""
    reports = [check_runs({name: runs[name] for name in jobs}, raise_on_failure=False, precision=policy,
                          **planned.judging) for policy, jobs in planned.groups]
    return Report([r for rep in reports for r in rep.rows], [x for rep in reports for x in rep.limits],
                  reports[0].overridden, reports[0].excluded)


def _is_low(policy: Any) -> bool:
    """Whether a policy computes or reduces in a dtype coarser than float32 (the low-precision rule's case)."""
    low = low_dtype(policy)
    return low is not None and torch.finfo(low).eps > torch.finfo(torch.float32).eps


def check_runs(runs: dict[str, Callable[[], list[list[Any]]]], init: Callable[[Any, Any], Any],
               loss: Callable[..., torch.Tensor], cfg: Any, batch: Any, *, steps: int = 3, optimizer: Any = None,
               clip_norm: float | None = None, seed: int = 0, terms: int | None = None, ulps: float | None = None,
               raise_on_failure: bool = True, where: str = "", precision: Any = None,
               tolerances: dict[str, float] | None = None, exclude: Sequence[str] = ()) -> Report:
    """:func:`check_equivalence` for any way of training: each of ``runs`` (by name) is a function returning, per
    step, one ``{"loss", "grads", "params"}`` tree of full plain tensors per rank; compared with the single-device
    reference (same optimizer, clipping, seed, and allowances) and reported the same way, detection limits
    included (measured on rank 0's values).

    >>> report = check_runs({"1f1b": my_pipeline_run}, models.gpt.init, models.gpt.loss, cfg, batch)  # doctest: +SKIP
    """
    optimizer = optimizer if optimizer is not None else functools.partial(core.optim.adamw, 1e-3)
    make = optimizer if not isinstance(optimizer, core.optim.GradientTransformation) else (lambda: optimizer)
    low = low_dtype(precision)
    tokens = max(1, *(torch.as_tensor(x).numel() for x in tree.leaves(batch)))
    terms, ulps = _rule(low, terms, ulps, tokens)
    loss_fn, key = functools.partial(loss, cfg=cfg), core.random.key(seed)
    initial = init(key, cfg)
    paths = [tree.keystr(p) for p, _ in tree.leaves_with_path(initial)]
    unknown = unknown_patterns(paths, tolerances, exclude)
    if unknown:
        raise ValueError(f"check_equivalence: the patterns {unknown} (tolerances/exclude) match no leaf of the params "
                         f"{paths}. Fix: write a regex that re.search finds in one of these key paths.")
    ref, slack = reference_steps(init, loss_fn, cfg, batch, make(), steps, key, clip_norm, terms, ulps, precision,
                            tolerances)
    rows: list[Row] = []
    limits: list[Limit] = []
    judge = None
    for name, run in runs.items():
        caught: dict[str, dict[str, float]] = {"loss": {}, "grads": {}, "params": {}}  # quantity -> leaf -> ε
        uncounted: dict[str, set[str]] = {"loss": set(), "grads": set(), "params": set()}  # not Judge.counted
        for i, ((ref_loss, ref_grads, ref_params), per_ranks) in enumerate(zip(ref, run(), strict=True)):
            before = ref[i - 1][2] if i else initial
            grads_judge = None
            for quantity, want in (("loss", ref_loss), ("grads", ref_grads), ("params", ref_params)):
                capped = {}  # params: at most a fraction of the step's own update away (UPDATE_FRACTION)
                if quantity == "params":
                    capped = dict(update=_update(want, before),
                                  noise_driven=[k for k in grads_judge.want if grads_judge.on_floor(k)])
                judge = Judge(want, terms=terms, ulps=ulps, dtype=low, slack=slack[i][quantity], tolerances=tolerances,
                              exclude=exclude, **capped)
                grads_judge = judge if quantity == "grads" else grads_judge
                results = [_compare(r[quantity], judge) for r in per_ranks]
                abs_, rel, used, path, ok = max(results, key=lambda r: (not r[4], r[2]))
                rows.append(Row(name, i + 1, quantity, abs_, rel, used, path or "<scalar>", ok))
                planted = detection_limit(judge, per_ranks[0][quantity], before if quantity == "params" else None)
                for leaf, eps in planted.items():  # planted at every step: caught at the step that catches most
                    caught[quantity][leaf] = min(eps, caught[quantity].get(leaf, math.inf))
                uncounted[quantity] |= set(judge.want) - set(planted)
        limits += summarize(name, caught, uncounted)
    report = Report(rows, limits, judge.overridden if judge else {}, judge.excluded if judge else [])
    return raise_if_failed(report, where) if raise_on_failure else report


def _update(after: Any, before: Any) -> dict[str, torch.Tensor]:
    """Per key path, the step's own update of each leaf: ``after - before``."""
    return {tree.keystr(k): a - b for (k, a), b in zip(tree.leaves_with_path(after), tree.leaves(before))}


def _rule(dtype: torch.dtype | None, terms: int | None, ulps: float | None, tokens: int) -> tuple[int, float]:
    """``(terms, ulps)`` of the rule for values computed in ``dtype``: the low-precision one for bf16/fp16
    (terms 1, :data:`~shardings.testing.tolerance.LOW_PRECISION_ULPS`), else fp32's (``tokens``, :data:`ULPS`);
    what the caller passed wins."""
    if dtype is not None and torch.finfo(dtype).eps > torch.finfo(torch.float32).eps:
        return terms or 1, ulps if ulps is not None else LOW_PRECISION_ULPS.get(dtype, 8.0)
    return terms or tokens, ulps if ulps is not None else ULPS


def raise_if_failed(report: Report, where: str) -> Report:
    if not report.ok:
        w = report.worst()
        raise EquivalenceError(
            f"layout {w.layout!r}{where}: {w.quantity} differ from the single-device reference at step {w.step}, "
            f"worst at {w.worst_path} (max abs {w.max_abs:.3e}, relative norm {w.rel_norm:.3e}, {w.used:.1f}x the "
            f"allowed difference).\n{report.table()}"
        )
    return report
