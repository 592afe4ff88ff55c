"""TeraPipe (``seq_chunks``) on real gloo processes, each rank running its own stage's chunks: equal to one device
(loss, grads, params after AdamW steps with accumulation and clipping) under pp, dp+pp, zero3+pp and tp+sp+pp, in
bf16 with its fp32 twin and compiled (``jit=True``). Every case runs in one launch of 4 ranks
(:func:`shardings.testing.check_equivalences`); each test judges its own."""

import pytest

from core.precision import Policy
from models import gpt
from shardings import Mesh
from shardings.testing import check_equivalences
from shardings.testing.equivalence import raise_if_failed

# 5 blocks on 4 stages with a tied embedding (its gradient summed from the first and the last rank); 3 on 2
FIVE = gpt.Config(vocab=64, dim=32, layers=5, heads=4, kv_heads=2, seq_len=12, mlp=64, tie_embeddings=True)
THREE = gpt.Config(vocab=64, dim=32, layers=3, heads=4, kv_heads=2, seq_len=12, mlp=64)
STEPS = 2
CASES = {
    "pp4-1f1b-uneven": dict(cfg=FIVE, layouts=["pp"], mesh=Mesh(pp=4), schedule="1f1b", accum_steps=4, seq_chunks=3,
                            chunk_sizes=(6, 4, 2)),
    "dp2xpp2-gpipe": dict(cfg=THREE, layouts=["dp+pp"], mesh=Mesh(dp=2, pp=2), schedule="gpipe", seq_chunks=2),
    "zero3-dp2xpp2-1f1b": dict(cfg=THREE, layouts=["zero3+pp"], mesh=Mesh(dp=2, pp=2), schedule="1f1b", seq_chunks=3),
    "tp-sp-pp2xtp2-1f1b": dict(cfg=THREE, layouts=["tp+sp+pp"], mesh=Mesh(pp=2, tp=2), schedule="1f1b", seq_chunks=3,
                               chunk_sizes=(6, 4, 2)),
    "bf16-zero3-dp2xpp2": dict(cfg=THREE, layouts=["zero3+pp"], mesh=Mesh(dp=2, pp=2), schedule="gpipe", seq_chunks=2,
                               precision=Policy.bf16_mixed()),
    "jit-dp2xpp2-1f1b": dict(cfg=THREE, layouts=["dp+pp"], mesh=Mesh(dp=2, pp=2), schedule="1f1b", seq_chunks=2,
                             jit=True, jit_backend="aot_eager"),
}


def _arguments(case: dict) -> dict:
    cfg = case["cfg"]
    return dict(init=gpt.init, loss=gpt.loss, axes=gpt.axes, batch=gpt.example_batch(cfg, 8, with_ignored=True),
                stages=gpt.stages, steps=STEPS, clip_norm=0.5, accum_steps=2) | case


@pytest.fixture(scope="module")
def reports():
    return check_equivalences({name: _arguments(case) for name, case in CASES.items()}, raise_on_failure=False)


@pytest.mark.parametrize("name", list(CASES))
def test_real_ranks_equal_one_device(reports, name):
    report = raise_if_failed(reports[name], f" (case {name!r})")
    runs = 2 if "precision" in CASES[name] else 1  # bf16: and its fp32 twin
    assert len(report.rows) == 3 * STEPS * runs, report.table()
