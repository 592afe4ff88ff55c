"""A cluster layout checked on a laptop: GPT-3 175B's shape (ZeRO-2 over 8 data-parallel ranks × 4 pipeline stages ×
2-way tensor parallelism, 64 GPUs) on 64 simulated ranks with a tiny GPT, one AdamW step with microbatches and
clipping, equal to one device. Part of the default suite: about 25 s on 2 shared CPU cores."""

import models
from shardings import Mesh
from shardings.testing import check_equivalence

# 4 blocks: one per stage; heads, kv_heads, mlp and vocab split over tp=2; 2 rows per data-parallel rank
TINY = models.gpt.Config(vocab=32, dim=16, layers=4, heads=2, kv_heads=2, seq_len=4, mlp=32)


def test_gpt3_layout_zero2_tp_pp_on_64_simulated_ranks_equals_one_device():
    mesh = Mesh(dp=8, pp=4, tp=2)
    assert mesh.size == 64
    microbatches = 2
    batch = models.gpt.example_batch(TINY, mesh.axis_size("dp") * microbatches, with_ignored=True)
    report = check_equivalence(models.gpt.init, models.gpt.loss, models.gpt.axes, TINY, batch,
                               layouts=["zero2+tp+pp"], mesh=mesh, stages=models.gpt.stages, schedule="1f1b",
                               accum_steps=microbatches, clip_norm=0.5, steps=1)
    assert {r.quantity for r in report.rows} == {"loss", "grads", "params"} and report.ok
