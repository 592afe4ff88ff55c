"""``shardings.plan``: estimates for every candidate, exact numbers for the best, a ranking that explains itself."""

import dataclasses
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import models
import shardings
from shardings.planner import Candidate, Cluster, Link, Space, enumerate_candidates
from shardings.planner import exact as exacts
from shardings.planner import search as searches

CFG = models.gpt.Config(vocab=64, dim=32, layers=4, heads=4, kv_heads=2, mlp=64, seq_len=16)


def _cluster(memory: float = 1e9) -> Cluster:
    return Cluster("tiny", 1, 4, memory, {"float32": 1e10}, 1.0, 1e10, 1e-5, 1e-4, False, Link(1e-4, 1e9),
                   Link(1e-4, 1e9), 1e10)


@pytest.fixture(scope="module")
def ranking():
    space = Space(remat=(False,), schedules=("1f1b",), max_microbatches=2, offload=False, accumulate=False)
    return shardings.plan(models.gpt, CFG, (8, 16), _cluster(), space=space, top_k=2, budget_s=1e9)


def test_the_ranking_is_by_predicted_time_and_its_winner_ran_on_fake_tensors(ranking):
    totals = [r.timing.total for r in ranking.rows]
    assert totals == sorted(totals) and len(ranking.rows) == ranking.searched - len(ranking.dropped)
    assert sum(r.prediction.exact for r in ranking.rows) >= 2
    assert ranking.winner.prediction.exact
    table = ranking.table(5)
    assert f"winner: {ranking.winner.candidate}" in table and len(table.splitlines()) == 2 + 5 + 1


def test_explain_breaks_down_memory_comm_compute_and_compares_with_the_winner(ranking):
    loser = ranking.rows[-1].candidate
    text = ranking.explain(loser)
    for part in ("memory per rank", "params", "opt_state", "activations", "communication per rank", "compute:",
                 "vs the winner"):
        assert part in text
    assert re.search(r"\d\.\d\d× its step", text)
    assert ranking.row(loser).prediction.exact  # explained on fake tensors, searched or not


def test_fits_answers_yes_or_no_with_the_breakdown():
    cand = Candidate("zero3", (("dp", 4),))
    small = shardings.plan(models.gpt, CFG, (8, 16), _cluster(memory=1e3), candidates=[cand], top_k=1)
    big = shardings.plan(models.gpt, CFG, (8, 16), _cluster(), candidates=[cand], top_k=1)
    no, yes = small.fits(cand), big.fits(cand)
    assert not no and yes and no.peak == yes.peak
    assert str(no).startswith("fits: no") and str(yes).startswith("fits: yes") and "opt_state" in str(yes)
    assert small.dropped[cand].startswith("does not fit:") and not small.rows


def test_a_candidate_the_step_cannot_run_is_dropped_with_the_step_s_reason():
    bad = Candidate("tp", (("tp", 4),))  # kv_heads=2 cannot split over 4
    ranking = shardings.plan(models.gpt, CFG, (8, 16), _cluster(), candidates=[bad], top_k=1)
    assert "kv_heads" in ranking.dropped[bad] and "not divisible by 4" in ranking.dropped[bad]
    with pytest.raises(ValueError, match=r"no candidate fits.*Fix"):
        ranking.winner  # noqa: B018


def test_a_candidate_whose_exact_prediction_raises_is_dropped_with_its_error_and_the_search_goes_on(monkeypatch):
    broken, fine = Candidate("zero3", (("dp", 4),)), Candidate("zero2", (("dp", 4),))
    exact = exacts.exact

    def exact_or_bug(model, cfg, rows, cand, *args):
        if cand == broken:
            raise TypeError("a planted bug\nsecond line")
        return exact(model, cfg, rows, cand, *args)

    monkeypatch.setattr(exacts, "exact", exact_or_bug)
    ranking = shardings.plan(models.gpt, CFG, (8, 16), _cluster(), candidates=[broken, fine], top_k=2, budget_s=1e9)
    assert ranking.dropped[broken] == "its exact prediction failed: TypeError: a planted bug"
    assert [r.candidate for r in ranking.rows] == [fine] and ranking.winner.prediction.exact
    assert f"failed: {broken}: its exact prediction failed: TypeError: a planted bug" in ranking.table()
    assert ranking.explain(broken) == f"{broken}: dropped — its exact prediction failed: TypeError: a planted bug"


# -- the time budget, under a fake clock: the search's seconds are the stand-in exact runs' prices alone ----------
class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _budgeted(monkeypatch, candidates, budget_s, rate):
    """A search whose exact runs cost ``rate`` fake seconds per work unit (the first run's cheapest fake step, which
    ``first_step_seconds`` measures, counted once); returns it and the ``(start, end)`` of every exact run."""
    clock, runs, period = _Clock(), [], 1
    first = 2 * period  # the work units of the cheapest fake step (2p blocks, one microbatch)

    def first_step(*args):
        clock.now += first * rate
        return rate

    def fake_exact(model, cfg, rows, cand, optimizer, period_, est, **kw):
        start = clock.now - (first * rate if not runs else 0.0)  # the first run began with its cheapest step
        clock.now = start + exacts.work_units(cand, period_) * rate
        runs.append((start, clock.now))
        return dataclasses.replace(est, exact=True)

    monkeypatch.setattr(searches, "_clock", clock)
    monkeypatch.setattr(exacts, "first_step_seconds", first_step)
    monkeypatch.setattr(exacts, "exact", fake_exact)
    ranking = shardings.plan(models.gpt, CFG, (8, 16), _cluster(), candidates=candidates, top_k=len(candidates),
                             budget_s=budget_s)
    return ranking, runs


FLAT = [Candidate("dp", (("dp", 4),)), Candidate("zero1", (("dp", 4),)), Candidate("zero2", (("dp", 4),)),
        Candidate("zero3", (("dp", 4),)), Candidate("hsdp", (("dp", 2), ("fsdp", 2)))]  # 5 work units each


@settings(max_examples=10, deadline=None)
@given(st.integers(0, len(FLAT)), st.floats(1e-3, 10.0), st.floats(0.0, 0.99))
def test_a_budget_that_admits_exactly_n_exact_runs_sees_n(n, rate, spare):
    units = exacts.work_units(FLAT[0], 1)
    assert all(exacts.work_units(c, 1) == units for c in FLAT)
    with pytest.MonkeyPatch.context() as monkeypatch:
        ranking, runs = _budgeted(monkeypatch, FLAT, (n + spare) * units * rate, rate)
    assert len(runs) == n == sum(r.prediction.exact for r in ranking.rows), (n, runs)


POOL = enumerate_candidates(4, CFG, 8, 16, per_node=4, space=Space(remat=(False,), max_microbatches=4,
                                                                    offload=False))


@settings(max_examples=10, deadline=None)
@given(st.lists(st.sampled_from(POOL), min_size=2, max_size=8, unique=True), st.floats(1e-3, 1.0),
       st.floats(0.0, 400.0))
def test_no_exact_run_starts_whose_price_ends_past_the_budget(cands, rate, budget_s):
    with pytest.MonkeyPatch.context() as monkeypatch:
        ranking, runs = _budgeted(monkeypatch, cands, budget_s, rate)
    assert all(end <= budget_s * (1 + 1e-9) for _, end in runs), (budget_s, runs)
    assert len(runs) == len(ranking.checked)  # each run beside its own estimate


@given(st.sampled_from(POOL), st.integers(1, 3))
def test_the_price_of_an_exact_run_grows_with_blocks_times_microbatches(cand, period):
    """``work_units``: more microbatches (same layout, mesh and schedule) or a longer period never cost less, and a
    longer period costs more."""
    units = exacts.work_units(cand, period)
    assert exacts.work_units(cand, period + 1) > units
    more = [c for c in POOL if dataclasses.replace(c, microbatches=cand.microbatches) == cand
            and c.microbatches > cand.microbatches]
    for c in more:
        assert exacts.work_units(c, period) >= units, (str(cand), str(c))
