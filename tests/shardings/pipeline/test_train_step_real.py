"""train_step with pp on real gloo processes: each rank runs its own stage; equal to one device (loss, grads and
params after AdamW steps with accumulation and clipping; each block read from the rank that owns it)."""

import pytest

import core
import models
import shardings
from shardings import Mesh
from shardings.step import ownership
from shardings.testing import check_equivalence

# 5 blocks on 4 stages; a tied embedding: its gradient is summed from the first and the last rank
FIVE = models.gpt.Config(vocab=64, dim=32, layers=5, heads=4, kv_heads=2, seq_len=8, mlp=64, tie_embeddings=True)
THREE = models.gpt.Config(vocab=64, dim=32, layers=3, heads=4, kv_heads=2, seq_len=8, mlp=64)
# backward recomputes a remat block outside the stage's call, where the stage's rules must still hold
REMAT = models.gpt.Config(vocab=64, dim=32, layers=3, heads=4, kv_heads=2, seq_len=8, mlp=64, remat=True)


@pytest.mark.parametrize("layouts,mesh,cfg,schedule", [
    (["pp"], Mesh(pp=4), FIVE, "1f1b"),
    (["dp+pp"], Mesh(dp=2, pp=2), THREE, "gpipe"),
    (["tp+sp+pp"], Mesh(dp=2, pp=2, tp=2), THREE, "1f1b"),
    (["zero3+pp"], Mesh(dp=2, pp=2), THREE, "1f1b"),  # gathered once per step; other stages' blocks not gathered
    (["tp+sp+pp"], Mesh(pp=2, tp=2), REMAT, "zb_h1"),
], ids=["pp4", "dp2xpp2", "dp2xpp2xtp2", "zero3-dp2xpp2", "remat-pp2xtp2"])
def test_real_ranks_equal_one_device(layouts, mesh, cfg, schedule):
    batch = models.gpt.example_batch(cfg, 8, with_ignored=True)
    check_equivalence(models.gpt.init, models.gpt.loss, models.gpt.axes, cfg, batch, layouts=layouts, mesh=mesh,
                      stages=models.gpt.stages, schedule=schedule, accum_steps=4 if mesh.size == 4 else 2,
                      clip_norm=0.5, steps=2, runtime="multiprocess")


def _grad_norms(cfg, batch) -> list[float]:
    mesh = Mesh(dp=2, pp=2)
    params = shardings.init(models.gpt.init, core.random.key(0), cfg, axes=models.gpt.axes(cfg), layout="dp+pp",
                            mesh=mesh)
    step = shardings.train_step(models.gpt.stages(cfg), core.optim.adamw(1e-3), layout="dp+pp", mesh=mesh,
                                plan=shardings.pipeline.plan("dp+pp", mesh, params, microbatches=2), clip_norm=0.5)
    return [step(params, step.init(params), batch)[2]["grad_norm"]]


def test_the_grad_norm_metric_adds_every_stage_once():
    batch = models.gpt.example_batch(FIVE, 8)
    want = float(core.optim.global_norm(core.grad(models.gpt.loss)(models.gpt.init(core.random.key(0), FIVE),
                                                                     batch, FIVE)))
    for (norm,) in shardings.launch(_grad_norms, 4, FIVE, batch):
        assert norm == pytest.approx(want, rel=1e-5)


def _held(cfg, batch) -> dict:
    mesh = Mesh(pp=4)
    params = shardings.init(models.gpt.init, core.random.key(0), cfg, axes=models.gpt.axes(cfg), layout="pp",
                            mesh=mesh)
    step = shardings.train_step(models.gpt.stages(cfg), core.optim.adamw(1e-3), layout="pp", mesh=mesh,
                                plan=shardings.pipeline.plan("pp", mesh, params, microbatches=4))
    state = step.init(params)
    params, state, metrics = step(params, state, batch)
    held = [path for path, x in core.tree.leaves_with_path(params) if not ownership.is_absent(x)]
    return {"blocks": sorted({p[1].idx for p in held if getattr(p[0], "key", None) == "blocks"}),
            "params": metrics["memory"]["params"], "opt_state": metrics["memory"]["opt_state"]}


def test_each_rank_holds_only_its_own_stage():
    cfg = models.gpt.Config(vocab=64, dim=32, layers=8, heads=4, kv_heads=2, seq_len=8, mlp=64)
    params = models.gpt.init(core.random.key(0), cfg)
    block = sum(x.numel() * 4 for x in core.tree.leaves(params["blocks"][0]))
    edges = sum(x.numel() * 4 for k, v in params.items() if k != "blocks" for x in core.tree.leaves(v))
    ranks = shardings.launch(_held, 4, cfg, models.gpt.example_batch(cfg, 8))
    assert [r["blocks"] for r in ranks] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    for r in ranks:  # two blocks and the edge parameters; AdamW's two moments of the same, plus its step count
        assert r["params"] == 2 * block + edges
        assert 2 * (2 * block + edges) <= r["opt_state"] <= 2 * (2 * block + edges) + 64
