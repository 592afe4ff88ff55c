"""Every schedule through the train step: interleaved 1F1B and the zero-bubble schedules place several stages on
a rank (``Schedule.rank_of``), and the step, ``shardings.init`` and the checkpoint-free equivalence agree on it."""

import pytest
import torch

from models import gpt
from shardings import Mesh
from shardings.pipeline import build
from shardings.testing import check_equivalence

CFG = gpt.Config(vocab=64, dim=32, layers=4, heads=4, kv_heads=2, mlp=64, seq_len=16)
BATCH = gpt.example_batch(CFG, 8)


def _check(layout, mesh, schedule, **kw):
    report = check_equivalence(gpt.init, gpt.loss, gpt.axes, CFG, BATCH, layouts=[layout], mesh=mesh,
                               stages=gpt.stages, schedule=schedule, steps=2, accum_steps=4, clip_norm=1.0, **kw)
    assert report.ok and len(report.rows) == 6


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zb_h1", "zb_v"])
def test_each_schedule_trains_like_one_device(schedule):
    _check("dp+pp", Mesh(dp=2, pp=2), schedule)


def test_interleaved_with_three_chunks_per_rank_on_tp():
    cfg = gpt.Config(vocab=64, dim=32, layers=6, heads=4, kv_heads=2, mlp=64, seq_len=16)
    report = check_equivalence(gpt.init, gpt.loss, gpt.axes, cfg, gpt.example_batch(cfg, 8), layouts=["tp+sp+pp"],
                               mesh=Mesh(pp=2, tp=2), stages=gpt.stages, steps=2, accum_steps=4,
                               schedule=build("interleaved_1f1b", 2, 4, virtual_stages=3))
    assert report.ok


@pytest.mark.skipif(torch.__version__ < (2, 13), reason="zero-bubble W on real processes needs torch >= 2.13 "
                    "(2.11's autograd cannot restart backward from a custom Function's node: compat.grad_from_edges)")
@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zb_v"])
def test_two_stages_per_rank_on_real_processes(schedule):
    _check("pp", Mesh(pp=2), schedule, runtime="multiprocess")
