"""shardings.pipeline.plan: a run's schedule, microbatches and split made once from shapes, and who owns which
block; the defaults written once; bad plans refused with a fix."""

import pytest

import core
import models
from core import deferred
from shardings import Mesh, ShardingError, layouts, pipeline

CFG = models.gpt.Config(vocab=64, dim=32, layers=5, heads=4, kv_heads=2, seq_len=8, mlp=64)


def _shapes(cfg=CFG):
    with deferred.deferred():  # recipes: shapes only, nothing drawn
        return models.gpt.init(core.random.key(0), cfg)


def test_a_plan_from_recipes_holds_the_schedule_the_split_and_the_owners():
    plan = pipeline.plan("dp+pp", Mesh(dp=2, pp=2), _shapes(), schedule="zb_v", microbatches=4)
    assert (plan.schedule.name, plan.pp, plan.microbatches, plan.split.stages) == ("zb_v", 2, 4, 4)
    # ZB-V's V: rank 0 runs the first and the last stage, rank 1 the two in the middle
    owners = [plan.owner(b) for b in range(CFG.layers)]
    assert owners == [plan.schedule.rank_of(plan.split.stage_of(b)) for b in range(CFG.layers)]
    assert plan.blocks_of(0) | plan.blocks_of(1) == set(range(CFG.layers)) and not plan.blocks_of(0) & plan.blocks_of(1)
    assert plan.blocks_of(0) == {b for b in range(CFG.layers) if plan.split.stage_of(b) in (0, 3)}
    per_leaf = plan.owners(_shapes())
    paths = [core.tree.keystr(p) for p, _ in core.tree.leaves_with_path(_shapes())]
    assert all((o is None) == ("blocks" not in p) for o, p in zip(per_leaf, paths))  # edges: every rank
    assert "stage 0: blocks" in str(plan) and "zb_v: pp=2, microbatches=4" in str(plan)


@pytest.mark.parametrize(("kw", "want"), [
    ({}, ("1f1b", 2)),  # DEFAULT_SCHEDULE, one microbatch per pp rank
    ({"accum_steps": 4}, ("1f1b", 4)),  # accum_steps when > 1
    ({"accum_steps": 4, "microbatches": 6}, ("1f1b", 6)),  # microbatches win
    ({"schedule": "gpipe", "microbatches": 3}, ("gpipe", 3)),
])
def test_defaults_are_written_once(kw, want):
    plan = pipeline.plan("pp", Mesh(pp=2), _shapes(), **kw)
    assert (plan.schedule.name, plan.microbatches) == want
    assert pipeline.DEFAULT_SCHEDULE == "1f1b"


def test_a_given_schedule_is_checked_and_kept():
    schedule = pipeline.build("interleaved_1f1b", 2, 4, virtual_stages=2)
    plan = pipeline.plan("pp", Mesh(pp=2), _shapes(), schedule=schedule, stage_sizes=[2, 1, 1, 1])
    assert plan.schedule is schedule and [len(r) for r in plan.split.ranges] == [2, 1, 1, 1]
    assert plan.blocks_of(0) == {0, 1, 3}  # round robin: stages 0 and 2 on rank 0
    with pytest.raises(ShardingError, match=r"is for 2 ranks and 4 microbatches; the step has pp=2, m=8.*Fix"):
        pipeline.plan("pp", Mesh(pp=2), _shapes(), schedule=schedule, microbatches=8)
    with pytest.raises(ShardingError, match=r"is for 2 ranks .* pp=4"):
        pipeline.plan("pp", Mesh(pp=4), _shapes(), schedule=schedule)


def test_bad_plans_are_refused_before_any_work():
    with pytest.raises(ShardingError, match=r"layout 'zero3' does not pipeline the blocks.*Fix: add pp"):
        pipeline.plan("zero3", Mesh(dp=2), _shapes())
    with pytest.raises(ValueError, match="5 blocks cannot fill 6 stages"):
        pipeline.plan("pp", Mesh(pp=3), _shapes(), schedule="zb_v")
    with pytest.raises(ValueError, match=r"sizes \[3, 1\] must be 2 positive counts adding up to the 5 blocks"):
        pipeline.plan("pp", Mesh(pp=2), _shapes(), stage_sizes=[3, 1])
    with pytest.raises(pipeline.ScheduleError, match="unknown pipeline schedule 'zbv'"):
        pipeline.plan("pp", Mesh(pp=2), _shapes(), schedule="zbv")


def test_plan_for_is_the_one_way_init_and_train_step_get_theirs():
    shapes, mesh = _shapes(), Mesh(pp=2)
    assert pipeline.plan_for("dp", Mesh(dp=2), shapes, schedule="gpipe") is None  # no pp: no plan
    made = pipeline.plan_for(layouts.get("pp"), mesh, shapes, schedule="gpipe", microbatches=4)
    assert made == pipeline.plan("pp", mesh, shapes, schedule="gpipe", microbatches=4)
    assert pipeline.plan_for("pp", mesh, shapes, made, schedule="zb_v") is made  # a given plan wins
    with pytest.raises(ShardingError, match="a pipeline plan for pp=2 was given for layout 'dp'"):
        pipeline.plan_for("dp", Mesh(dp=2), shapes, made)
    with pytest.raises(ShardingError, match="a pipeline plan for pp=2 was given for layout 'pp' on Mesh\\(pp=4\\)"):
        pipeline.plan_for("pp", Mesh(pp=4), shapes, made)
