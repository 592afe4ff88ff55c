"""``shardings.plan``: estimates for every candidate, exact numbers for the best, a ranking that explains itself."""

import re

import pytest

import models
import shardings
from shardings.planner import Candidate, Cluster, Link, Space
from shardings.planner import exact as exacts

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
    assert ranking.overrides() == ranking.winner.candidate.overrides()
    table = ranking.table(5)
    assert "winner: layout=" in table and len(table.splitlines()) == 2 + 5 + 1


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
