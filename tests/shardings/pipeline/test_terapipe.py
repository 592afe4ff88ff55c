"""TeraPipe (``seq_chunks``): each microbatch's sequence cut into chunks that flow through the stages in order,
a chunk attending over the earlier chunks' keys and values; equal to one device on simulated ranks (loss, grads,
params after AdamW steps with accumulation and clipping) under pp, dp+pp, zero3+pp and tp+sp+pp, in fp32 and
bf16 (with its fp32 twin)."""

import pytest

from core.precision import Policy
from models import gpt
from shardings import Mesh
from shardings.testing import check_equivalence

CFG = gpt.Config(vocab=64, dim=32, layers=3, heads=4, kv_heads=2, seq_len=12, mlp=64)  # 3 blocks on 2 stages
BATCH = gpt.example_batch(CFG, 8, with_ignored=True)


def _check(layouts, mesh, schedule="1f1b", seq_chunks=3, steps=2, **kw):
    return check_equivalence(gpt.init, gpt.loss, gpt.axes, CFG, BATCH, layouts=layouts, mesh=mesh, stages=gpt.stages,
                             schedule=schedule, accum_steps=2, clip_norm=0.5, steps=steps, seq_chunks=seq_chunks,
                             **kw)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp_with_uneven_chunks_equals_one_device(schedule):
    report = _check(["pp"], Mesh(pp=2), schedule, chunk_sizes=(6, 4, 2))
    assert report.ok


def test_data_presets_compose():
    _check(["dp+pp", "zero3+pp"], Mesh(dp=2, pp=2), seq_chunks=2)


def test_tp_sp_composes_on_a_3d_mesh():
    _check(["tp+sp+pp"], Mesh(pp=2, tp=2), steps=1, chunk_sizes=(6, 4, 2))


def test_bf16_with_its_fp32_twin():
    _check(["zero3+pp"], Mesh(dp=2, pp=2), precision=Policy.bf16_mixed(), steps=1)


def test_remat_recomputes_a_chunk_with_its_prefix():
    cfg = gpt.Config(vocab=64, dim=32, layers=3, heads=4, kv_heads=2, seq_len=12, mlp=64, remat=True)
    check_equivalence(gpt.init, gpt.loss, gpt.axes, cfg, gpt.example_batch(cfg, 8), layouts=["pp"], mesh=Mesh(pp=2),
                      stages=gpt.stages, schedule="gpipe", accum_steps=2, steps=1, seq_chunks=2)
