"""pp composed with every other parallelism (zero3, hsdp, tp, sp, cp, ep) equals one device on simulated ranks:
loss, grads and params after AdamW steps with microbatches and clipping. ZeRO-3 inside a stage gathers the stage's
weights once per step: its collectives do not grow with the microbatches."""

import pytest

import core
import models
import shardings
from shardings import Mesh
from shardings.testing import check_equivalence

GPT = models.gpt.Config(vocab=64, dim=32, layers=3, heads=4, kv_heads=2, seq_len=8, mlp=64)  # 3 blocks on 2 stages
MOE = models.moe.Config(vocab=64, dim=32, layers=3, heads=4, kv_heads=2, seq_len=8, mlp=32, experts=4, top_k=2)


def _check(module, cfg, layout, mesh, schedule="1f1b", microbatches=2, steps=2):
    batch = module.example_batch(cfg, 8, with_ignored=True)
    return check_equivalence(module.init, module.loss, module.axes, cfg, batch, layouts=[layout], mesh=mesh,
                             stages=module.stages, schedule=schedule, accum_steps=microbatches, clip_norm=0.5,
                             steps=steps)


def test_zero3_tp_sp_pp_equals_one_device():
    _check(models.gpt, GPT, "zero3+tp+sp+pp", Mesh(dp=2, pp=2, tp=2))


def test_tp_sp_cp_pp_equals_one_device():
    _check(models.gpt, GPT, "tp+sp+cp+pp", Mesh(pp=2, cp=2, tp=2))


def test_ep_pp_on_moe_equals_one_device():
    _check(models.moe, MOE, "ep+pp", Mesh(ep=2, pp=2), schedule="gpipe", microbatches=4)


def test_hsdp_pp_equals_one_device():
    _check(models.gpt, GPT, "hsdp+pp", Mesh(dp=2, fsdp=2, pp=2))


def _comm(layout, mesh, microbatches):
    batch = models.gpt.example_batch(GPT, 8)
    with shardings.simulate(mesh.size):
        params = shardings.init(models.gpt.init, core.random.key(0), GPT, axes=models.gpt.axes(GPT), layout=layout,
                                mesh=mesh)
        step = shardings.train_step(models.gpt.stages(GPT), core.optim.adamw(1e-3), layout=layout, mesh=mesh,
                                    plan=shardings.pipeline.plan(layout, mesh, params, microbatches=microbatches))
        metrics = step(params, step.init(params), batch)[2]
    return {r["kind"]: (r["count"], r["bytes"]) for r in metrics["comm"] if r["axis"] == "dp"}


@pytest.mark.parametrize("microbatches", [2, 4])
def test_zero3_in_a_stage_gathers_once_per_step(microbatches):
    leaves = core.tree.leaves(models.gpt.init(core.random.key(0), GPT))
    n = 2
    moved = (n - 1) * sum(x.numel() * 4 for x in leaves) // n  # (N−1)/N of the fp32 weights, per rank
    # simulated ranks run every stage, so each rank gathers the whole model: one all-gather per block and one for
    # the rest (embedding, final norm, head), whatever m; the gradients reduce-scattered once, leaf by leaf
    comm = _comm("zero3+pp", Mesh(dp=2, pp=2), microbatches)
    assert comm["all_gather"] == (GPT.layers + 1, moved)
    assert comm["reduce_scatter"] == (len(leaves), moved)
    assert "all_reduce" not in comm


def test_zero3_without_pp_gathers_per_microbatch():
    """The contrast: plain ZeRO-3's accumulation gathers each block in forward and again in backward, per
    microbatch (one block at a time held), so its gathers grow with m where the pipeline's do not."""
    def gathers(m):
        batch = models.gpt.example_batch(GPT, 8)
        mesh = Mesh(dp=2)
        with shardings.simulate(2):
            params = shardings.init(models.gpt.init, core.random.key(0), GPT, axes=models.gpt.axes(GPT),
                                    layout="zero3", mesh=mesh)
            step = shardings.train_step(lambda p, b: models.gpt.loss(p, b, GPT), core.optim.adamw(1e-3),
                                        layout="zero3", mesh=mesh, accum_steps=m)
            rows = step(params, step.init(params), batch)[2]["comm"]
        return next(r["count"] for r in rows if r["kind"] == "all_gather")
    assert gathers(4) > gathers(2) >= 2 * GPT.layers
