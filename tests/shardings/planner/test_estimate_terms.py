"""The quick estimate, term by term, against the exact prediction of the same candidate (its real train step on
fake tensors), on a grid of presets with and without tp, sp, pp, remat and bf16 (4 ranks, the tiny gpt).

Each term has a stated bound on exact / estimated; the combined peak and step time are checked against
``estimate.ESTIMATE_BOUNDS`` (what the search states beside an estimated row). Collectives are compared per kind ×
mesh axis × phase (forward, backward, the update after backward: ``shardings.planner.fake_step.PHASES``), the fake
step telling the phases apart as they run. Worst ratios on this grid when written (2026-11-28): params, compute,
grads 1 (equal); opt_state 1 + AdamW's step count (4 bytes); every collective kind × axis × phase 1 (equal bytes,
rows under 1 KiB aside: the loss's scalars), ZeRO-3's backward re-gathers under remat included; the pipeline's
sends 1 per phase; saved activations as the step measures them (a pipelined rank's peak; without pp the whole step's,
seen beneath ZeRO-3's re-gather hooks) 0.73-1.19 of the estimate's term, and the memory model's activations term
at the peak (corrected by the exact run: what the peak leaves, where grads and the optimizer's transients come
after the activations are freed) 0.52-1.19; activations + buffers 0.52-1.04 (accumulation's buffer now counted: was
1.98); step time 1.07-1.87; peak 0.76-1.02.
"""

import dataclasses

import pytest

import core
import models
from shardings.planner import Candidate, Cluster, Link, step_time
from shardings.planner import estimate as estimates
from shardings.planner import exact as exacts
from shardings.planner.candidates import layout_of
from shardings.planner.fake_step import PHASES, measure
from shardings.planner.memory import ROLES
from shardings.planner.model_profile import block_period
from shardings.planner.search import _profiles

CFG = models.gpt.Config(vocab=64, dim=32, layers=4, heads=4, kv_heads=2, mlp=64, seq_len=16)
ROWS = 8
PIPE = (("pp", 2), ("dp", 2))
CLUSTER = Cluster("test", 1, 4, 1e12, {"float32": 1e10, "bfloat16": 1e10}, 1.0, 1e10, 1e-5, 1e-4, False,
                  Link(1e-4, 1e9), Link(1e-4, 1e9), 1e10)
GRID = [Candidate("dp", (("dp", 4),)),
        Candidate("zero3", (("dp", 4),)),
        Candidate("zero3", (("dp", 4),), 1, None, None, True, "bf16"),
        Candidate("dp+tp", (("dp", 2), ("tp", 2))),
        Candidate("zero1+tp+sp", (("dp", 2), ("tp", 2)), 2, None, None, False, "bf16"),
        Candidate("zero1+pp", PIPE, 4, "1f1b"),
        Candidate("tp+pp", (("pp", 2), ("tp", 2)), 2, "1f1b"),
        Candidate("tp+sp+pp", (("pp", 2), ("tp", 2)), 2, "1f1b", None, True, "bf16"),
        # zero bubble under remat: what a microbatch awaiting W holds (memory_terms.AWAITING_W_REMAT), three cases
        Candidate("zero1+pp", PIPE, 4, "zb_h1", None, True),
        Candidate("zero2+pp", PIPE, 4, "zb_h1", None, True, "bf16"),
        Candidate("zero3+pp", PIPE, 2, "zb_v", None, True)]
# exact / estimated per collective kind × axis class × phase (rows under SLACK bytes both ways are the loss's scalars)
_TERMS = [("all_gather", "data", "forward"), ("all_gather", "data", "backward"), ("all_gather", "data", "update"),
          ("reduce_scatter", "data", "backward"), ("reduce_scatter", "data", "update"),
          ("all_reduce", "data", "forward"), ("all_reduce", "data", "backward"), ("all_reduce", "data", "update"),
          *((kind, "tp", phase) for kind in ("all_reduce", "all_gather", "reduce_scatter") for phase in PHASES),
          ("send", "pp", "forward"), ("send", "pp", "backward")]
COMM_BOUNDS = dict.fromkeys(_TERMS, (1.0, 1.0))
# ZeRO-3 under remat (not pp): the estimate counts one backward re-gather a block, as without remat; the step
# gathers each block once in backward, fp32 and bf16 (the recomputation's, which the block's backward then uses, as
# FSDP with activation checkpointing: tests/shardings/residency/test_zero3_remat.py): equal
REMAT_BOUNDS = {("all_gather", "data", "backward"): (1.0, 1.0)}
SLACK = 1024
TRANSIENT = (0.5, 1.1)  # activations + buffers
# the saved activations the step measures (a pipelined rank's without remat; every step without pp) against the
# estimate's term: the one-device profile's saved tensors, split over tp/cp, are an upper bound but for ZeRO-3 +
# remat + bf16 (1.19; not the checkpoint's cast weights, which no longer reach backward: the ratio was the same
# before and after that fix, 29,800 saved bytes either way; its cause is not pinned down)
ACTIVATIONS = (0.7, 1.25)
# a pipelined rank's (without remat), which the schedule counts: the profile's saved tensors are an upper bound
ACTIVATIONS_PP = (0.7, 1.0)
# the memory model's activations term as an exact run corrects it (at most what the peak leaves besides the held
# roles: dp's peak is at the end of forward, before any gradient, so half its saved bytes show as this term)
ACTIVATIONS_AT_PEAK = (0.5, 1.25)


def _predictions(cand: Candidate):
    opt, period = core.optim.adamw(1e-3), block_period(models.gpt, CFG)
    est = estimates.estimate(models.gpt, CFG, ROWS, cand, opt, _profiles(models.gpt, CFG, cand), period)
    return est, exacts.exact(models.gpt, CFG, ROWS, cand, opt, period, est)


def _within(x: float, e: float, bounds: tuple[float, float], slack: float = 0.0) -> bool:
    lo, hi = bounds
    return lo * e - slack <= x <= hi * e + slack


def _axis_class(axis: str) -> str:
    return "data" if axis in ("dp", "fsdp") else axis


@pytest.mark.parametrize("cand", GRID, ids=str)
def test_each_estimate_term_is_within_its_bound_of_the_exact_step(cand):
    est, ex = _predictions(cand)
    for role in ("params", "compute", "grads"):
        assert round(est.memory[role]) == ex.memory[role], role
    assert 0 <= ex.memory["opt_state"] - est.memory["opt_state"] <= 16  # AdamW's step count, not per parameter
    transient = [p.memory["activations"] + p.memory["buffers"] for p in (est, ex)]
    assert _within(transient[1], transient[0], TRANSIENT), transient
    if not cand.remat or not cand.pipelined:  # measured by the step (under pp, B's recomputation is not seen)
        bounds = ACTIVATIONS_PP if cand.pipelined else ACTIVATIONS_AT_PEAK
        assert ex.memory["activations"] > 0
        assert _within(ex.memory["activations"], est.memory["activations"], bounds), \
            (est.memory["activations"], ex.memory["activations"])
    for p in (est, ex):  # the phases add up to the rows
        assert {k: sum(b for (kind, axis, _), (_, b) in p.phases.items() if (kind, axis) == k)
                for k in p.comm} == {k: b for k, (_, b) in p.comm.items()}, p.exact
    for key in set(est.phases) | set(ex.phases):
        e, x = (float(p.phases.get(key, (0, 0))[1]) for p in (est, ex))
        kind, axis, phase = key
        term = (kind, _axis_class(axis), phase)
        bounds = REMAT_BOUNDS.get(term) if cand.remat and "zero3" in cand.layout and not cand.pipelined else None
        assert _within(x, e, bounds or COMM_BOUNDS[term], SLACK), (key, e, x)
    steps = [step_time(p, CLUSTER).total for p in (est, ex)]
    assert _within(steps[1], steps[0], estimates.ESTIMATE_BOUNDS["step"]), steps
    assert _within(ex.peak, est.peak, estimates.ESTIMATE_BOUNDS["peak"]), (est.peak, ex.peak)
    assert sorted(ex.memory) == sorted(ROLES)


FLAT = [c for c in GRID if not c.pipelined]


@pytest.mark.parametrize("cand", FLAT, ids=str)
def test_without_pp_the_step_measures_the_saved_activations_the_estimate_counts(cand):
    """The fake step's saved-activation peak without pp (seen beneath ZeRO-3's re-gather hooks, which save gathered
    weights as handles: not activations) is within ACTIVATIONS of the estimate's term, nonzero, smaller under remat;
    the exact run's activations term is that measurement, at most what the peak leaves besides the held roles."""
    est, ex = _predictions(cand)
    runs = {remat: measure(models.gpt, dataclasses.replace(CFG, remat=remat), layout=cand.layout,
                           mesh=dict(cand.mesh), batch_rows=ROWS, microbatches=cand.microbatches,
                           precision=_policy(cand.precision)) for remat in (False, True)}
    saved = {remat: max(m.saved) for remat, m in runs.items()}
    assert 0 < saved[True] < saved[False], saved
    assert _within(saved[cand.remat], est.memory["activations"], ACTIVATIONS), (est.memory["activations"], saved)
    at_peak = ex.memory["activations"] + ex.memory["buffers"]
    assert ex.memory["activations"] == pytest.approx(min(saved[cand.remat], at_peak)), (ex.memory, saved)


def _policy(name: str):
    make = core.precision.NAMED[name]
    return make() if make else None


def test_the_grid_covers_exactly_the_presets_the_estimate_states_a_bound_for():
    covered = set().union(*(layout_of(c.layout).presets for c in GRID))
    assert covered == estimates.ESTIMATE_TESTED
