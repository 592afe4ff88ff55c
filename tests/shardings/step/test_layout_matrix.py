"""Every preset and the common compositions, on meshes where each of their axes is real (size 2).

The property test in test_train_step.py draws meshes and layouts at random; this matrix makes
sure each data strategy, TP and SP meet at least once with nothing degenerate (no size-1 axes),
with GQA, tied embeddings, ignored labels, clipping and gradient accumulation all on.
"""

import dataclasses

import pytest

import models.gpt as gpt
from shardings import Mesh
from shardings.testing import check_equivalence

CFG = gpt.Config(vocab=60, dim=32, layers=1, heads=4, kv_heads=2, mlp=64, seq_len=8, tie_embeddings=True)


@pytest.mark.parametrize(
    ("layouts", "mesh", "accum"),
    [
        (["dp", "zero1", "zero2", "zero3", "hsdp"], Mesh(dp=2, fsdp=2), 2),
        (["tp", "tp+sp", "zero2+tp", "zero3+tp+sp", "hsdp+tp"], Mesh(fsdp=2, tp=2), 1),
    ],
    ids=["data-strategies", "tensor-parallel"],
)
def test_layout_matrix_matches_the_single_device_reference(layouts, mesh, accum):
    cfg = dataclasses.replace(CFG, tie_embeddings=accum == 2)
    batch = gpt.example_batch(cfg, 8, with_ignored=True)
    report = check_equivalence(gpt.init, gpt.loss, gpt.axes, cfg, batch, layouts=layouts, mesh=mesh, steps=2,
                               accum_steps=accum, clip_norm=0.5)
    assert report.ok and {r.layout for r in report.rows} == set(layouts)
