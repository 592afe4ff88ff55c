"""``shardings.plan``: enumerate, estimate every candidate, run the promising ones on fake tensors, rank.

1. Candidates from the registries (:mod:`shardings.planner.candidates`).
2. Every candidate's exact model state (one per signature: layout, mesh, precision and blocks per rank), and
   those that cannot hold it dropped at once; the rest estimated (:mod:`shardings.planner.estimate`,
   microseconds each), timed on the cluster (:mod:`shardings.planner.cost`), and dropped when their estimated
   peak exceeds a rank's memory by more than ``slack``.
3. The fastest estimates are run exactly (:mod:`shardings.planner.exact`: fake steps at two depths), best first,
   until ``top_k`` exact candidates fit and no estimate left is faster than the ``top_k``-th exact one, or
   ``budget_s`` is spent. One whose exact prediction would end past it is not run (it stays an estimate, and a
   cheaper one after it may run): its price is its blocks × microbatches on fake tensors
   (:func:`~shardings.planner.exact.work_units`: a pipeline's probes run each rank's microbatches) at the most
   seconds per unit seen so far, the first priced by its own cheapest fake step. An exact
   candidate that does not fit is dropped with its numbers, and so is an estimate over the memory; one whose
   exact prediction raises is dropped with the error (listed under the table) and the search goes on. An estimate
   that the exact runs so far say will not fit (its peak times their
   median ratio of exact to estimated peak) is not run; it stays in the table, marked as an estimate. The
   estimates leave things out (the step's own ops and copies): each is scaled by the median ratio of exact to
   estimated time seen so far, so the exact and the estimated rows rank on one scale.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from shardings.planner import estimate as estimates
from shardings.planner import exact as exacts
from shardings.planner.candidates import Candidate, Space, enumerate_candidates
from shardings.planner.cluster import Cluster
from shardings.planner.cost import step_time
from shardings.planner.model_profile import block_period, profile
from shardings.planner.ranking import Ranking, Row, describe_drop, describe_failure, describe_state_drop
from shardings.spec.errors import ShardingError

__all__ = ["plan"]


def plan(model: Any, cfg: Any, batch_shape: tuple[int, int], cluster: Cluster, *, optimizer: Any = None,
         space: Space | None = None, top_k: int = 8, budget_s: float = 40.0, slack: float = 1.25,
         candidates: list[Candidate] | None = None) -> Ranking:
    """Rank layouts × meshes × microbatches × schedules × remat × precision × offload by predicted step time.

    Nothing is allocated: the model's init runs deferred and its steps on fake tensors, as rank 0 of the
    cluster's world (the ``"fake"`` process group).

    Args:
        model: the model module (``init``, ``axes``, ``loss``, ``stages``, ``example_batch``, a frozen ``Config``).
        cfg: its config (``layers``, and for the estimates ``dim``, heads, experts when it has them).
        batch_shape: ``(rows, seq_len)`` of the global batch per step.
        cluster: the cluster (``shardings.planner.Cluster``, e.g. from ``experiments/conf/cluster``).
        optimizer: the optimizer (default ``core.optim.adamw``).
        space: what to search besides layouts and meshes (:class:`~shardings.planner.Space`; default ``Space()``).
        top_k: how many candidates to predict exactly (fake steps), fastest estimates first.
        budget_s: seconds of exact predictions at most (counted after the estimates): none starts that would end
            past it at the most seconds per work unit seen so far (module docstring).
        slack: drop a candidate whose *estimated* peak exceeds memory by more than this factor (model state
            alone: any excess).
        candidates: search these instead of enumerating (e.g. one layout to check).

    Returns:
        A :class:`~shardings.planner.Ranking` (``print`` it; ``.explain(candidate)``, ``.fits(candidate)``,
        ``.overrides()``).

    >>> ranking = shardings.plan(models.gpt, cfg, (8, 128), cluster)  # doctest: +SKIP
    >>> print(ranking.table(5))  # doctest: +SKIP
    """
    import core

    start = time.perf_counter()
    rows, seq = batch_shape
    cfg = dataclasses.replace(cfg, seq_len=seq)
    optimizer = optimizer if optimizer is not None else core.optim.adamw(1e-3)
    if candidates is None:
        candidates = enumerate_candidates(cluster.world, cfg, rows, seq, per_node=cluster.per_node,
                                          space=space or Space())
    period = block_period(model, cfg)
    profiles = {}
    for precision, remat in {(c.precision, c.remat) for c in candidates}:
        profiles |= _profiles_of(model, cfg, precision, remat)
    dropped: dict[Candidate, str] = {}
    estimated: list[Row] = []
    for cand in candidates:
        try:  # exact model state first, one per signature: what cannot hold it is dropped before anything else
            state = estimates.model_state_memory(model, cfg, cand.layout, cand.mesh, cand.precision,
                                                 estimates.busiest_blocks(cfg, cand), period, optimizer)
            if sum(state.values()) > cluster.memory:
                dropped[cand] = describe_state_drop(state, cluster)
                continue
            pred = estimates.estimate(model, cfg, rows, cand, optimizer, profiles, period)
        except ValueError as e:  # ShardingError too: the layout cannot split this model (heads over tp, ...)
            dropped[cand] = f"cannot run: {str(e).splitlines()[0]}"
            continue
        if pred is None:
            dropped[cand] = f"schedule {cand.schedule} cannot run pp={cand.size('pp')} with {cand.microbatches} " \
                            "microbatches"
            continue
        state = sum(pred.memory[r] for r in ("params", "compute", "grads", "opt_state"))
        if state > cluster.memory or pred.peak > slack * cluster.memory:
            dropped[cand] = describe_drop(pred, cluster)
            continue
        estimated.append(Row(pred, step_time(pred, cluster)))
    estimated.sort(key=lambda r: r.timing.total)

    def predict(cand: Candidate) -> Any:
        est = estimates.estimate(model, cfg, rows, cand, optimizer, profiles | _profiles(model, cfg, cand), period)
        if est is None:
            raise ValueError(f"{cand}: its schedule cannot be built for these sizes")
        return exacts.exact(model, cfg, rows, cand, optimizer, period, est)

    exact: list[Row] = []
    ratios: list[float] = []  # exact / estimated step time of each candidate run exactly
    peaks: list[float] = []  # and peak memory
    exact_start, rate = time.perf_counter(), None  # seconds per work unit of an exact prediction, the most so far
    for row in estimated:
        scale = _median(ratios)
        kth = sorted(r.timing.total for r in exact)[top_k - 1] if len(exact) >= top_k else None
        if (kth is not None and row.timing.total * scale >= kth) or time.perf_counter() - exact_start > budget_s:
            break
        if row.prediction.peak * _median(peaks) > cluster.memory:  # the exact runs so far say it will not fit
            continue
        if row.candidate.seq_chunks > 1:  # TeraPipe: the exact probes run whole sequences; it stays an estimate
            continue
        started, units = time.perf_counter(), exacts.work_units(row.candidate, period)
        try:
            if rate is None:  # priced by its own cheapest fake step, which its exact run reuses
                rate = exacts.first_step_seconds(model, cfg, rows, row.candidate, optimizer, period)
            if time.perf_counter() - exact_start + units * rate > budget_s:
                continue  # would end past the budget: it stays an estimate (a cheaper one may still run)
            pred = predict(row.candidate)
        except (ShardingError, ValueError, RuntimeError) as e:
            dropped[row.candidate] = f"the step refuses it: {str(e).splitlines()[0]}"
            continue
        except Exception as e:  # a bug in its step or probe: this candidate's failure, not the search's
            dropped[row.candidate] = describe_failure(e)
            continue
        finally:
            rate = max(rate or 0.0, (time.perf_counter() - started) / units)
        timed = Row(pred, step_time(pred, cluster))
        ratios.append(timed.timing.total / row.timing.total)
        peaks.append(pred.peak / row.prediction.peak)
        if pred.peak > cluster.memory:
            dropped[row.candidate] = describe_drop(pred, cluster)
            continue
        exact.append(timed)
    done = {r.candidate for r in exact} | set(dropped)
    scale = _median(ratios)  # what the estimates leave out, as the exact runs found it: scale the rest
    ranked = list(exact)
    for r in estimated:
        if r.candidate in done:
            continue
        if r.prediction.peak > cluster.memory:  # within the slack (worth running exactly), but not run: no evidence
            dropped[r.candidate] = describe_drop(r.prediction, cluster)
            continue
        ranked.append(Row(r.prediction, dataclasses.replace(r.timing, total=r.timing.total * scale)))
    return Ranking(ranked, dropped, cluster, time.perf_counter() - start, len(candidates), predict)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else 1.0


def _profiles(model: Any, cfg: Any, cand: Candidate) -> dict:
    """The one-device profiles ``cand``'s estimate reads (:func:`_profiles_of`)."""
    return _profiles_of(model, cfg, cand.precision, cand.remat)


def _profiles_of(model: Any, cfg: Any, precision: str, remat: bool | str) -> dict:
    """Profiles under ``remat``, and without (what a zero-bubble rank's microbatch awaiting W holds under remat:
    the recomputed activations), by ``(compute dtype, remat)``."""
    compute = estimates.DTYPES[precision][0]
    return {(compute, bool(r)): profile(model, dataclasses.replace(cfg, remat=r), compute) for r in {remat, False}}
