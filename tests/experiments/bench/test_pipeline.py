"""experiments.bench.pipeline on the tiny config: exact activation bytes, bubble and step-time rows (no timings)."""

import pytest

import core
import models.gpt as gpt
from experiments.bench import pipeline as bench_pipeline
from shardings import pipeline

TINY = ["--config", "tiny", "--steps", "1"]
PP = bench_pipeline.PP


def test_stage0_peak_is_m_microbatches_for_gpipe_and_at_most_pp_for_1f1b():
    ms = [1, 2, 4, 8]
    rows = bench_pipeline.main(["--part", "a", "--ms", *map(str, ms), *TINY])["a"]
    assert [(r["schedule"], r["m"]) for r in rows] == [(s, m) for s in ("gpipe", "1f1b") for m in ms]
    one = rows[0]["one_microbatch_bytes"]
    assert one > 0 and all(r["one_microbatch_bytes"] == one for r in rows)
    for r in rows:
        held = r["m"] if r["schedule"] == "gpipe" else min(PP, r["m"])
        assert r["stage0_peak_bytes"] == held * one  # exact: saved_peak counts bytes, each microbatch its own storage
        assert r["planned"] == held and r["ratio"] == held


@pytest.mark.multiprocess
def test_bubble_rows_per_rank_and_the_formula():
    ms = [2, 4]
    rows = bench_pipeline.main(["--part", "b", "--ms", *map(str, ms), *TINY])["b"]  # one launch
    assert [(r["schedule"], r["m"]) for r in rows] == [(s, m) for s in ("gpipe", "1f1b") for m in ms]
    for r in rows:
        fractions = [r[f"rank{k}"] for k in range(PP)]
        assert all(0 < f < 1 for f in fractions)
        assert r["mean"] == pytest.approx(sum(fractions) / PP, abs=2e-3)  # of the unrounded fractions
        assert 0 < r["in_sends"] < r["mean"]  # sends are part of the idle time, not all of it (rank 0 never receives F)
        assert r["formula"] == round((PP - 1) / (r["m"] + PP - 1), 3) == r["planned"]


@pytest.mark.multiprocess
def test_step_time_rows_for_pp_dp_zero3_after_the_same_update():
    """One launch, one timed step per variant; the bench itself raises unless all three variants' losses agree at
    steps 1 and 2, so pp's update of each rank's own stage covers every parameter the model uses."""
    rows = bench_pipeline.main(["--part", "c", "--rounds", "1", "--batch", "8", "--m", "4", *TINY])["c"]
    assert [r["variant"] for r in rows] == ["pp", "dp", "zero3"]
    pp = rows[0]
    assert pp["microbatches"] == 4 and pp["pp_over_this"] == 1.0
    for r in rows:
        assert r["step_ms"] > 0 and r["batch_rows"] == 8
        assert r["pp_over_this"] == pytest.approx(pp["step_ms"] / r["step_ms"], rel=0.01)  # step_ms rounded to 0.1
        assert r["loss_step2"] == pytest.approx(pp["loss_step2"], rel=1e-4)


def test_own_parameters_cover_each_stage_once():
    """_own: each block on exactly one rank; the embedding, final norm and unembedding on the first and the last."""
    cfg = gpt.Config(**bench_pipeline._CONFIGS["tiny"])
    params = gpt.init(core.random.key(0), cfg)
    split = pipeline.split(params, PP)
    owned = [bench_pipeline._own(params, split, r) for r in range(PP)]
    blocks = [id(b) for o in owned for b in o["blocks"]]
    assert sorted(blocks) == sorted(id(b) for b in params["blocks"])
    rest = set(params) - {"blocks"}
    assert [set(o) - {"blocks"} for o in owned] == [rest, set(), set(), rest]
