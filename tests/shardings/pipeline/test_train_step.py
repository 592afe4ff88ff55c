"""train_step with pp: the pipeline across stages and dp/zero1/zero2/tp/sp inside each, equal to one device
(loss, grads, params after AdamW steps with accumulation over microbatches and clipping), on simulated ranks."""

import pytest
import torch

import core
import models
import shardings
from shardings import Mesh, Rules, ShardingError, layouts
from shardings.step import pipeline_path
from shardings.testing import EquivalenceError, check_equivalence

GPT = models.gpt.Config(vocab=64, dim=32, layers=3, heads=4, kv_heads=2, seq_len=8, mlp=64)  # 3 blocks on 2 stages
MOE = models.moe.Config(vocab=64, dim=32, layers=3, heads=4, kv_heads=2, seq_len=8, mlp=32, experts=4, top_k=2)


def _check(module, cfg, layouts, mesh, schedule, steps=2, microbatches=2):
    batch = module.example_batch(cfg, 8, with_ignored=True)
    return check_equivalence(module.init, module.loss, module.axes, cfg, batch, layouts=layouts, mesh=mesh,
                             stages=module.stages, schedule=schedule, accum_steps=microbatches, clip_norm=0.5,
                             steps=steps)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp_alone_equals_one_device(schedule):
    _check(models.gpt, GPT, ["pp"], Mesh(pp=2), schedule, steps=3, microbatches=4)


def test_data_parallel_presets_compose_with_pp():
    _check(models.gpt, GPT, ["dp+pp", "zero1+pp", "zero2+pp"], Mesh(dp=2, pp=2), "1f1b")


def test_tp_sp_composes_with_pp_on_a_3d_mesh():
    _check(models.gpt, GPT, ["tp+sp+pp"], Mesh(dp=2, pp=2, tp=2), "1f1b", steps=1)


def test_moe_under_pp():
    _check(models.moe, MOE, ["pp"], Mesh(pp=2), "gpipe", microbatches=4)


def test_a_one_percent_error_in_a_microbatch_weight_is_caught(monkeypatch):
    real_run = pipeline_path.run
    monkeypatch.setattr(pipeline_path, "run", lambda sch, st, sp, p, mbs, w, **kw: real_run(
        sch, st, sp, p, mbs, [w[0] * 1.01, *w[1:]], **kw))
    with pytest.raises(EquivalenceError, match="'dp\\+pp'"):
        _check(models.gpt, GPT, ["dp+pp"], Mesh(dp=2, pp=2), "1f1b", steps=1)


def test_metrics_count_p2p_per_rank_and_report_the_pipeline():
    batch = models.gpt.example_batch(GPT, 8)
    mesh, m = Mesh(dp=2, pp=2), 4
    with shardings.simulate(4):
        params = shardings.init(models.gpt.init, core.random.key(0), GPT, axes=models.gpt.axes(GPT),
                                layout="dp+pp", mesh=mesh)
        plan = shardings.pipeline.plan("dp+pp", mesh, params, microbatches=m, schedule="gpipe")
        step = shardings.train_step(models.gpt.stages(GPT), core.optim.adamw(1e-3), layout="dp+pp", mesh=mesh,
                                    plan=plan)
        _, _, metrics = step(params, step.init(params), batch)
    one = 8 // (m * 2) * GPT.seq_len * GPT.dim * 4  # a dp rank's microbatch rows · s · h, float32
    assert {"kind": "send", "axis": "pp", "count": 2 * m, "bytes": 2 * m * one} in metrics["comm"]
    assert metrics["pipeline"]["schedule"] == "gpipe" and metrics["pipeline"]["microbatches"] == m
    assert metrics["pipeline"]["bubble_planned"] == pytest.approx(1 / (m + 1))


@pytest.fixture
def user_preset(monkeypatch):
    """A user's preset (pp composes with the built-in ones only), registered into a copy of the table."""
    monkeypatch.setattr(layouts, "_PRESETS", dict(layouts._PRESETS))
    mlp_only = Rules(mlp="tp")
    layouts.register("mlp_tp", layouts.Layout(params=mlp_only, compute=mlp_only, grads=mlp_only, opt_state=mlp_only),
                     group="tp", needs=(("tp",),), tier="tensor")


def test_bad_input_is_refused_before_any_work(user_preset):
    mesh = Mesh(pp=2)
    with shardings.simulate(2):
        params = shardings.init(models.gpt.init, core.random.key(0), GPT, axes=models.gpt.axes(GPT), layout="pp",
                                mesh=mesh)
        with pytest.raises(TypeError, match="does not declare its stages"):
            shardings.train_step(lambda p, b: models.gpt.loss(p, b, GPT), core.optim.sgd(0.1), layout="pp", mesh=mesh)
        with pytest.raises(ShardingError, match="does not compose with \\['mlp_tp'\\]"):
            shardings.train_step(models.gpt.stages(GPT), core.optim.sgd(0.1), layout="mlp_tp+pp",
                                 mesh=Mesh(pp=2, tp=1))
        with pytest.raises(TypeError, match=r"needs the run's pipeline plan.*Fix: pass plan=shardings\.pipeline"):
            shardings.train_step(models.gpt.stages(GPT), core.optim.sgd(0.1), layout="pp", mesh=mesh)
        for gone in ("schedule", "microbatches", "stage_sizes", "virtual_stages"):
            with pytest.raises(TypeError, match=rf"train_step\({gone}=\.\.\.\) is gone: pass plan=shardings\.pipeline"):
                shardings.train_step(models.gpt.stages(GPT), core.optim.sgd(0.1), layout="pp", mesh=mesh,
                                     **{gone: 2})
        with pytest.raises(ValueError, match="sizes"):
            shardings.pipeline.plan("pp", mesh, params, stage_sizes=[3, 0])
        step = shardings.train_step(models.gpt.stages(GPT), core.optim.sgd(0.1), layout="pp", mesh=mesh,
                                    plan=shardings.pipeline.plan("pp", mesh, params, microbatches=3))
        with pytest.raises(ShardingError, match="not divisible"):
            step(params, step.init(params), models.gpt.example_batch(GPT, 8))
    one_layer = models.gpt.Config(vocab=64, dim=32, layers=1, heads=4, kv_heads=2, seq_len=8, mlp=64)
    with shardings.simulate(2):  # init makes the pipeline plan (its split) too: the same error, before any work
        with pytest.raises(ValueError, match="1 blocks cannot fill 2 stages"):
            shardings.init(models.gpt.init, core.random.key(0), one_layer, axes=models.gpt.axes(one_layer),
                           layout="pp", mesh=mesh)
        params = shardings.init(models.gpt.init, core.random.key(0), GPT, axes=models.gpt.axes(GPT), layout="pp",
                                mesh=mesh)
        with pytest.raises(ValueError, match="1 blocks cannot fill 2 stages"):  # the run's plan, from these params
            shardings.pipeline.plan("pp", mesh, {**params, "blocks": params["blocks"][:1]})
    assert torch.is_tensor(params["embed"])
