"""experiments.bench.pipeline_torch at tiny sizes: every pair runs on 4 gloo processes, both sides' step-1 losses
agree (the bench raises otherwise), and each row carries times, saved-activation peaks and bubbles (no
wall-clock assertions)."""

import pytest
import torch

from experiments.bench import pipeline_torch as bench_pipeline_torch


@pytest.mark.skipif(torch.__version__ < (2, 13), reason="zero-bubble W on real processes needs torch >= 2.13 "
                    "(2.11's autograd cannot restart backward from a custom Function's node: compat.grad_from_edges)")
def test_every_pair_runs_and_both_sides_agree():
    rows = bench_pipeline_torch.main(["--config", "tiny", "--m", "4", "--microbatch", "1", "--steps", "1"])
    assert [(r["ours"], r["torch"]) for r in rows] == list(bench_pipeline_torch.PAIRS.items())
    for r in rows:
        assert abs(r["loss_ours"] - r["loss_torch"]) <= 1e-5 * max(1.0, abs(r["loss_torch"]))
        assert r["ours_ms"] > 0 and r["torch_ms"] > 0 and r["ours_over_torch"] > 0
        assert r["ours_saved_peak_mb"] > 0 and r["torch_saved_peak_mb"] > 0
        assert 0 <= r["ours_bubble"] < 1 and 0 <= r["torch_bubble"] < 1 and 0 <= r["planned"] < 1
