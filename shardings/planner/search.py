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
   seconds per unit seen so far, the first priced by its own cheapest fake step. An exact candidate that does not
   fit is dropped with its numbers, and so is an estimate over the memory; one whose exact prediction raises is
   dropped with the error (listed under the table) and the search goes on.
4. Every row is ranked on its own best-known prediction: its exact one where it ran, else its estimate. An exact
   run corrects its own candidate only (no ratio found on one candidate rescales or skips another); the estimates'
   error found by the exact runs (:class:`~shardings.planner.ranking.Checked`) is stated beside the estimated
   rows (:meth:`~shardings.planner.Ranking.table`), not applied to them.
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
from shardings.planner.memory import ROLES, StepMemory, corrected
from shardings.planner.model_profile import block_period, profile, row_tokens
from shardings.planner.ranking import Checked, Ranking, Row, describe_drop, describe_failure, describe_state_drop
from shardings.spec.errors import ShardingError

__all__ = ["peak_by_role", "plan"]

_clock = time.perf_counter  # the search's clock (its budget's seconds); a test's fake clock replaces it


def plan(model: Any, cfg: Any, batch_shape: tuple[int, int | None], cluster: Cluster, *, optimizer: Any = None,
         space: Space | None = None, top_k: int = 8, budget_s: float = 40.0, slack: float = 1.25,
         candidates: list[Candidate] | None = None) -> Ranking:
    """Rank layouts × meshes × microbatches × schedules × remat × precision × offload by predicted step time.

    Nothing is allocated: the model's init runs deferred and its steps on fake tensors, as rank 0 of the
    cluster's world (the ``"fake"`` process group).

    Args:
        model: the model module (``init``, ``axes``, ``loss``, ``stages``, ``example_batch``, a frozen ``Config``).
        cfg: its config (``layers``, and for the estimates ``dim``, heads, experts when it has them).
        batch_shape: ``(rows, seq_len)`` of the global batch per step; ``seq_len`` ``None``: the config's own (a
            config without ``seq_len``, an image model: its tokens per row, measured from its example batch).
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
        A :class:`~shardings.planner.Ranking` (``print`` it; ``.explain(candidate)``, ``.fits(candidate)``;
        ``experiments.auto.train_overrides(ranking.winner.candidate)`` runs the winner).

    >>> ranking = shardings.plan(models.gpt, cfg, (8, 128), cluster)  # doctest: +SKIP
    >>> print(ranking.table(5))  # doctest: +SKIP
    """
    import core

    start = _clock()
    rows, seq = batch_shape
    cfg, space = _searchable(model, cfg, seq, space or Space(), cluster, candidates)
    seq = cfg.seq_len
    optimizer = optimizer if optimizer is not None else core.optim.adamw(1e-3)
    if candidates is None:
        candidates = enumerate_candidates(cluster.world, cfg, rows, seq, per_node=cluster.per_node, space=space)
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
    checked: list[Checked] = []  # each exact run beside its own estimate: the estimates' error, as found here
    exact_start, rate = _clock(), None  # seconds per work unit of an exact prediction, the most so far
    for row in estimated:
        kth = sorted(r.timing.total for r in exact)[top_k - 1] if len(exact) >= top_k else None
        if (kth is not None and row.timing.total >= kth) or _clock() - exact_start > budget_s:
            break
        started, units = _clock(), exacts.work_units(row.candidate, period)
        try:
            if rate is None:  # priced by its own cheapest fake step, which its exact run reuses
                rate = exacts.first_step_seconds(model, cfg, rows, row.candidate, optimizer, period)
            if started - exact_start + units * rate > budget_s:  # from its start: its cheapest step is part of it
                continue  # would end past the budget: it stays an estimate (a cheaper one may still run)
            pred = predict(row.candidate)
        except (ShardingError, ValueError, RuntimeError) as e:
            dropped[row.candidate] = f"the step refuses it: {str(e).splitlines()[0]}"
            continue
        except Exception as e:  # a bug in its step or probe: this candidate's failure, not the search's
            dropped[row.candidate] = describe_failure(e)
            continue
        finally:
            rate = max(rate or 0.0, (_clock() - started) / units)
        timed = Row(pred, step_time(pred, cluster))
        checked.append(Checked(row.candidate, row.timing.total, timed.timing.total, row.prediction.peak, pred.peak))
        if pred.peak > cluster.memory:
            dropped[row.candidate] = describe_drop(pred, cluster)
            continue
        exact.append(timed)
    done = {r.candidate for r in exact} | set(dropped)
    ranked = list(exact)
    for r in estimated:  # each on its own estimate: no exact run of another candidate rescales it
        if r.candidate in done:
            continue
        if r.prediction.peak > cluster.memory:  # within the slack (worth running exactly), but not run: no evidence
            dropped[r.candidate] = describe_drop(r.prediction, cluster)
            continue
        ranked.append(r)
    return Ranking(ranked, dropped, cluster, _clock() - start, len(candidates), predict, checked)


def _searchable(model: Any, cfg: Any, seq: int | None, space: Space, cluster: Cluster,
                candidates: list[Candidate] | None) -> tuple[Any, Space]:
    """The config the search reads, and what this model and cluster let it try.

    The batch's ``seq`` is the config's ``seq_len`` (``None``: the config's own). A ``Config`` without a ``seq_len``
    (an image model) is planned at its own tokens per row, measured
    (:func:`~shardings.planner.model_profile.row_tokens`), which ``seq`` must be if given. A ``Config`` without a
    ``remat`` field is planned without remat. A field the ``Config`` lacks is added, fixed, in a subclass (the model
    never reads it) so that every estimate and fake step can read and set it. A cluster whose ranks compute on the
    host's CPU cores (``cores`` set) has no separate host memory: no offload."""
    fields = {f.name for f in dataclasses.fields(cfg)}
    added: dict[str, Any] = {}
    if "seq_len" in fields:
        cfg = dataclasses.replace(cfg, seq_len=seq) if seq is not None else cfg
    else:
        tokens = row_tokens(model, cfg)
        if seq is not None and seq != tokens:
            raise ValueError(f"batch_shape's seq_len={seq}: {type(cfg).__module__}.{type(cfg).__qualname__} has no "
                             f"seq_len field to set, and its rows are {tokens} tokens (its example batch, measured). "
                             f"Fix: pass seq_len={tokens} or None (the model's own), or give the Config a seq_len "
                             "field.")
        if not hasattr(cfg, "seq_len"):
            added["seq_len"] = tokens
    if "remat" not in fields:
        wanted = sorted({str(c.remat) for c in candidates or [] if c.remat})
        if wanted:
            raise ValueError(f"remat={wanted[0]}: {type(cfg).__module__}.{type(cfg).__qualname__} has no remat field "
                             "to recompute (or offload) its blocks with. Fix: remat=false, or give the Config a "
                             "remat field its blocks honor.")
        added["remat"] = False
        space = dataclasses.replace(space, remat=(False,))
    if added:
        base = type(cfg)
        frozen = base.__dataclass_params__.frozen
        extended = dataclasses.make_dataclass(base.__name__, [(k, Any, v) for k, v in added.items()], bases=(base,),
                                              frozen=frozen)
        extended.__module__, extended.__qualname__ = base.__module__, base.__qualname__
        cfg = extended(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init})
    if cluster.cores is not None:
        remat = tuple(r for r in space.remat if r != "offload") or (False,)
        space = dataclasses.replace(space, offload=False, remat=remat)
    return cfg, space


def peak_by_role(model: Any, cfg: Any, rows: int, cand: Candidate, optimizer: Any, held: dict[str, float],
                 peak: float, saved: float | None = None) -> StepMemory:
    """A run's measured peak by role: ``cand``'s :class:`~shardings.planner.memory.StepMemory` corrected by what
    its step measured, as an exact prediction corrects its estimate (:func:`~shardings.planner.memory.corrected`):
    the held roles as ``metrics["memory"]`` counts them, the activations as measured (``saved``: a pipelined rank's
    ``saved_peak``) or else estimated for ``cand`` (at most the peak less the held roles), the buffers the rest.

    Raises:
        ValueError: the planner cannot estimate ``cand`` (its schedule cannot be built for these sizes, a layout
            that does not split this model).

    >>> parts = peak_by_role(models.gpt, cfg, 8, Candidate("zero3", (("dp", 2),)), adamw, metrics["memory"],
    ...                      peak)  # doctest: +SKIP
    >>> parts.peak == peak  # doctest: +SKIP
    True
    """
    if saved is not None:  # measured: corrected() reads no estimate
        return corrected(StepMemory(*[0.0] * len(ROLES)), held, peak, saved)
    est = estimates.estimate(model, cfg, rows, cand, optimizer, _profiles(model, cfg, cand), block_period(model, cfg))
    if est is None:
        raise ValueError(f"{cand}: its schedule cannot be built for these sizes")
    return corrected(StepMemory(*(float(est.memory[r]) for r in ROLES)), held, peak, None)


def _profiles(model: Any, cfg: Any, cand: Candidate) -> dict:
    """The one-device profiles ``cand``'s estimate reads (:func:`_profiles_of`)."""
    return _profiles_of(model, cfg, cand.precision, cand.remat)


def _profiles_of(model: Any, cfg: Any, precision: str, remat: bool | str) -> dict:
    """Profiles under ``remat``, and without (what a zero-bubble rank's microbatch awaiting W holds under remat:
    the recomputed activations), by ``(compute dtype, remat)``."""
    compute = estimates.DTYPES[precision][0]
    if not hasattr(cfg, "remat"):  # a model without remat (models.mlp): its one profile
        return {(compute, False): profile(model, cfg, compute)}
    return {(compute, bool(r)): profile(model, dataclasses.replace(cfg, remat=r), compute) for r in {remat, False}}
