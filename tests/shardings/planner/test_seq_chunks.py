"""The planner knows TeraPipe's ``seq_chunks``: candidates with chunks where the schedule cuts sequences and
attention's sequence is whole, their overrides run them, and their estimate is the whole sequences' with the chunked
schedule's bubble, activations held and per-chunk counts."""

import dataclasses

import core
import models
from shardings.pipeline import build
from shardings.planner import Candidate
from shardings.planner import estimate as estimates
from shardings.planner import exact as exacts
from shardings.planner.candidates import Space, enumerate_candidates
from shardings.planner.model_profile import block_period
from shardings.planner.search import _profiles

CFG = models.gpt.Config(vocab=64, dim=32, layers=4, heads=4, kv_heads=2, mlp=64, seq_len=64)


def test_candidates_with_chunks_only_where_a_schedule_cuts_sequences():
    found = enumerate_candidates(4, CFG, 8, 64, per_node=4, space=Space(seq_chunks=(1, 4), remat=(False,)))
    chunked = [c for c in found if c.seq_chunks > 1]
    assert chunked and {c.schedule for c in chunked} == {"gpipe", "1f1b"}
    assert all(c.size("cp") == 1 and c.seq_chunks == 4 for c in chunked)
    assert {dataclasses.replace(c, seq_chunks=1) for c in chunked} <= set(found)  # beside its whole-sequence twin
    cand = chunked[0]
    assert " k4 " in f"{cand} "  # experiments.auto.train_overrides: tests/experiments/test_plan_cli.py
    assert not [c for c in enumerate_candidates(4, CFG, 8, 64, per_node=4) if c.seq_chunks > 1]  # default: none


def test_a_chunked_estimate_has_the_chunked_bubble_fewer_activations_and_k_times_the_sends():
    opt, period = core.optim.adamw(1e-3), block_period(models.gpt, CFG)
    whole = Candidate("pp", (("pp", 4),), 4, "1f1b")
    chunked = dataclasses.replace(whole, seq_chunks=4)
    a, b = (estimates.estimate(models.gpt, CFG, 8, c, opt, _profiles(models.gpt, CFG, c), period)
            for c in (whole, chunked))
    assert b.candidate == chunked and b.bubble == build("1f1b", 4, 4, seq_chunks=4).bubble() < a.bubble
    assert b.memory["activations"] == a.memory["activations"] * (7 / 4) / 4  # (p+k-1)/k microbatches instead of p
    assert b.comm[("send", "pp")] == (4 * a.comm[("send", "pp")][0], a.comm[("send", "pp")][1])
    assert b.flops == a.flops and b.memory["params"] == a.memory["params"]


def test_the_exact_run_of_a_chunked_candidate_runs_its_chunks_as_its_estimate_predicts():
    """The exact run of ``pp pp2 1f1b m2`` with ``k = 2`` chunks against the same candidate on whole sequences: the
    carries are ``k`` messages per microbatch with the same bytes in all; the activations held fall by the estimate's
    ratio, ``(p+k−1)/(k·p)`` = 3/4, measured at most 1.2× above it (each chunk's attention also saves its
    concatenation of the prefix's keys and values with its own: ``docs/pipeline.md``; 1.06× here); and the ops
    dispatched grow as the estimate's ``k``× for the blocks, less the step's once-per-step ops (the optimizer's)."""
    opt, period, k = core.optim.adamw(1e-3), block_period(models.gpt, CFG), 2
    whole = Candidate("pp", (("pp", 2),), 2, "1f1b")
    runs = {}
    for cand in (whole, dataclasses.replace(whole, seq_chunks=k)):
        est = estimates.estimate(models.gpt, CFG, 8, cand, opt, _profiles(models.gpt, CFG, cand), period)
        runs[cand.seq_chunks] = est, exacts.exact(models.gpt, CFG, 8, cand, opt, period, est)
    (est_w, ex_w), (est_c, ex_c) = runs[1], runs[k]
    assert ex_c.exact and ex_c.candidate.seq_chunks == k
    count, nbytes = ex_w.comm[("send", "pp")]
    assert ex_c.comm[("send", "pp")] == est_c.comm[("send", "pp")] == (k * count, nbytes)
    planned = est_c.memory["activations"] / est_w.memory["activations"]
    measured = ex_c.memory["activations"] / ex_w.memory["activations"]
    assert planned == 3 / 4 and planned <= measured <= 1.2 * planned
    ops = lambda p: sum(p.ops.values())
    assert 0.9 * k * ops(ex_w) <= ops(ex_c) < k * ops(ex_w) and ops(est_c) == k * ops(est_w)
