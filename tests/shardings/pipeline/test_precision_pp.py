"""A precision policy under pp: stage weights cast before their (ZeRO-3) gather, gradients reduced in the reduce
dtype, the loss scale folded into the microbatch weights; equal to the reference run with the same policy."""

import pytest

from core.precision import Policy
from models import gpt
from shardings import Mesh
from shardings.testing import check_equivalence

CFG = gpt.Config(vocab=64, dim=32, layers=3, heads=4, kv_heads=2, mlp=64, seq_len=16)
BATCH = gpt.example_batch(CFG, 8)


def _check(layouts, mesh, policy, **kw):
    report = check_equivalence(gpt.init, gpt.loss, gpt.axes, CFG, BATCH, layouts=layouts, mesh=mesh,  # the policy
                               stages=gpt.stages, precision=policy, steps=3, accum_steps=4, clip_norm=1.0,  # run alone:
                               fp32_twin=False, **kw)  # the fp32 twin is tests/shardings/testing/'s
    assert report.ok and len(report.rows) == 9 * len(layouts)


@pytest.mark.parametrize(("layouts", "mesh", "policy"), [
    (["pp", "zero3+pp"], Mesh(dp=2, pp=2), Policy.bf16_mixed()),
    (["tp+sp+pp"], Mesh(pp=2, tp=2), Policy.from_string("params=fp32,compute=bf16,reduce=bf16")),
    (["dp+pp"], Mesh(dp=2, pp=2), Policy.fp16_mixed()),
], ids=["bf16", "bf16-reduce", "fp16"])
def test_pipelines_match_the_reference_under_the_same_policy(layouts, mesh, policy):
    _check(layouts, mesh, policy)


def test_a_bf16_pipeline_on_real_processes_matches_the_reference():
    # zero1: each real rank updates its own stage's fp32 master shard (in the optimizer state) and gathers its bf16 copy
    _check(["zero1+pp"], Mesh(dp=2, pp=2), Policy.bf16_mixed(), runtime="multiprocess", schedule="gpipe")
