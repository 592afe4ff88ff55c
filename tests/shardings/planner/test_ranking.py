"""The ranking's scale: every row is ranked on its own best-known prediction (its exact run where it has one, else
its own estimate), whatever the exact runs of the other candidates found. The exact runs are stand-ins here (each
candidate's estimate with its FLOPs and peak scaled by a drawn factor: an outlier is any large one), so hypothesis
can draw many searches cheaply; the real exact runs are tested in test_exact.py and test_estimate_terms.py."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import core
import models
import shardings
from shardings.planner import Candidate, Cluster, Link, step_time
from shardings.planner import estimate as estimates
from shardings.planner import exact as exacts
from shardings.planner.ranking import error_bounds
from shardings.planner.search import _profiles

CFG = models.gpt.Config(vocab=64, dim=32, layers=4, heads=4, kv_heads=2, mlp=64, seq_len=16)
CANDIDATES = [Candidate("dp", (("dp", 4),)), Candidate("zero1", (("dp", 4),)), Candidate("zero2", (("dp", 4),)),
              Candidate("zero3", (("dp", 4),)), Candidate("hsdp", (("dp", 2), ("fsdp", 2))),
              Candidate("zero3", (("dp", 4),), 2), Candidate("dp+tp", (("dp", 2), ("tp", 2)))]
# 2 MB a rank: the estimates fit (0.5-1 MB), an exact run drawn over 2x does not
CLUSTER = Cluster("tiny", 1, 4, 2e6, {"float32": 1e10}, 1.0, 1e10, 1e-5, 1e-4, False, Link(1e-4, 1e9),
                  Link(1e-4, 1e9), 1e10)
factors = st.floats(0.05, 20.0)
OWN = {c: estimates.estimate(models.gpt, CFG, 8, c, core.optim.adamw(1e-3), _profiles(models.gpt, CFG, c), 1)
       for c in CANDIDATES}  # each candidate's own estimate


def _search(monkeypatch, time_factor: dict, peak_factor: dict, top_k: int):
    """A search whose exact run of candidate ``c`` is its estimate with FLOPs × ``time_factor[c]`` and every memory
    role × ``peak_factor[c]``."""
    def fake_exact(model, cfg, rows, cand, optimizer, period, est, **kw):
        return dataclasses.replace(est, exact=True, flops={k: v * time_factor[cand] for k, v in est.flops.items()},
                                   memory={k: v * peak_factor[cand] for k, v in est.memory.items()})

    monkeypatch.setattr(exacts, "exact", fake_exact)
    monkeypatch.setattr(exacts, "first_step_seconds", lambda *a: 0.0)
    return shardings.plan(models.gpt, CFG, (8, 16), CLUSTER, candidates=CANDIDATES, top_k=top_k, budget_s=1e9)


@settings(max_examples=15, deadline=None)
@given(st.fixed_dictionaries({c: factors for c in CANDIDATES}), st.fixed_dictionaries({c: factors for c in CANDIDATES}),
       st.integers(1, len(CANDIDATES)))
def test_rows_rank_on_their_own_best_known_prediction(time_factor, peak_factor, top_k):
    with pytest.MonkeyPatch.context() as monkeypatch:
        ranking = _search(monkeypatch, time_factor, peak_factor, top_k)
    assert len(ranking.rows) + len(ranking.dropped) == len(CANDIDATES)
    for row in ranking.rows:
        own = OWN[row.candidate]
        if row.prediction.exact:  # its own exact run: its estimate times its own factors, nobody else's
            assert row.prediction.peak == pytest.approx(own.peak * peak_factor[row.candidate], rel=1e-12)
        else:  # an estimate: its own numbers and step time, on no other candidate's scale
            assert row.prediction == own and row.timing == step_time(own, CLUSTER)
        assert row.timing == step_time(row.prediction, CLUSTER)
    totals = [r.timing.total for r in ranking.rows]
    assert totals == sorted(totals)
    # the exact runs that did not fit are dropped on their own numbers; the others are all in the table
    for c in ranking.checked:
        assert (c.candidate in ranking.dropped) == (c.exact_peak > CLUSTER.memory)
    bounds = error_bounds(ranking.checked)
    for c in ranking.checked:  # the stated bound covers every exact run of the search against its own estimate
        assert bounds["step"][0] <= c.ratios["step"] <= bounds["step"][1]
        assert bounds["peak"][0] <= c.ratios["peak"] <= bounds["peak"][1]
