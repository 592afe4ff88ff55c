"""64 simulated ranks in one process: a tiny gpt (GQA, RoPE, SwiGLU) under zero3+tp+sp+pp on Mesh(dp=4, pp=4, tp=4),
1F1B over 4 microbatches with clipping, one AdamW step, equals one device, every op going through shardlab's
per-rank loop (``shardings.simulated_calls``).
The small sibling of ``make test-scale`` (512 ranks, ``experiments.bench.scale``): 9.2 s on the 2-core machine at a
load of ~1 (120 s under a load of ~22)."""

import models.gpt as gpt
from shardings import Mesh, simulated_calls
from shardings.testing import check_equivalence

CFG = gpt.Config(vocab=32, dim=16, layers=4, heads=4, kv_heads=4, head_dim=4, seq_len=8, mlp=32)


def test_64_simulated_ranks_equal_one_device(monkeypatch):
    monkeypatch.delenv("SHARDLAB_SIMULATE_FAST", raising=False)
    mesh = Mesh(dp=4, pp=4, tp=4)
    batch = gpt.example_batch(CFG, 4 * 4, with_ignored=True)  # 4 microbatches of dp4 rows
    simulated_calls(reset=True)
    report = check_equivalence(gpt.init, gpt.loss, gpt.axes, CFG, batch, layouts=["zero3+tp+sp+pp"], mesh=mesh,
                               stages=gpt.stages, schedule="1f1b", accum_steps=4, clip_norm=0.5, steps=1)
    assert report.ok
    assert simulated_calls()["rank_ops"] > 0  # shardlab's loop ran (not torch's)
