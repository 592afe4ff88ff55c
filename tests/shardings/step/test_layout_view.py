"""shardings.describe_layout: every parameter group's specs per role, and a step's collectives."""

import dataclasses
import functools

import pytest

import core
import models.gpt as gpt
import models.moe as moe
import shardings
from shardings import Mesh, P
from shardings.spec.layouts import PARAM_ROLES as ROLES
from shardings.step.layout_view import describe

CFG = gpt.Config(vocab=64, dim=32, layers=3, heads=4, kv_heads=2, mlp=64, seq_len=8)


@pytest.mark.parametrize(("layout", "mesh"), [("zero3+tp+sp", Mesh(dp=2, tp=2)), ("hsdp", Mesh(dp=2, fsdp=2)),
                                              ("dp", Mesh(dp=4))])
def test_groups_collapse_blocks_and_specs_follow_the_rules(layout, mesh):
    params, axes = gpt.init(core.random.key(0), CFG), gpt.axes(CFG)
    view = describe(params, axes, layout, mesh)
    by_group = {r.group: r for r in view.rows}
    assert set(by_group) == {"embed", "final_norm", "unembed"} | {f"blocks[0-2].{k}" for k in params["blocks"][0]}
    assert all(r.count == 3 for g, r in by_group.items() if g.startswith("blocks"))
    rules = shardings.spec.layouts.get(layout)
    for role in ROLES:  # each row's spec is what the role's table gives the parameter's names
        want = shardings.logical_to_spec(axes["blocks"][1]["wq"], rules.role(role), mesh)
        assert by_group["blocks[0-2].wq"].specs[role] == want
        split = [a for e in want for a in ((e,) if isinstance(e, str) else e or ())]
        assert by_group["blocks[0-2].wq"].shares[role] == 1 / mesh.axis_size(tuple(split))
    text = view.text()
    assert text.splitlines()[0].startswith(f"layout '{rules.name}' on {mesh!r}")
    assert "blocks[0-2].wq" in text and "collectives" not in text


def test_zero3_tp_rows_read_as_the_design_table():
    view = describe(gpt.init(core.random.key(0), CFG), gpt.axes(CFG), "zero3+tp", Mesh(dp=2, tp=2))
    w_up = next(r for r in view.rows if r.group == "blocks[0-2].w_up")
    assert w_up.specs == {"params": P("dp", "tp"), "compute": P(None, "tp"), "grads": P("dp", "tp"),
                          "opt_state": P("dp", "tp")}
    assert w_up.shares == {"params": 0.25, "compute": 0.5, "grads": 0.25, "opt_state": 0.25}


def test_moe_blocks_group_by_kind_and_a_step_adds_its_collectives():
    cfg = moe.Config(vocab=64, dim=32, layers=4, heads=2, mlp=32, seq_len=8, experts=4)
    batch = moe.example_batch(cfg, 4)
    with shardings.simulate(4):
        mesh = Mesh(dp=2, ep=2)
        params = shardings.init(moe.init, core.random.key(0), cfg, axes=moe.axes(cfg), layout="dp+ep", mesh=mesh)
        step = shardings.train_step(functools.partial(moe.loss, cfg=cfg), core.optim.sgd(0.1), layout="dp+ep",
                                    mesh=mesh, axes=moe.axes(cfg))
        with shardings.comms() as c:
            step(params, step.init(params), batch)
    view = shardings.describe_layout(params, moe.axes(cfg), "dp+ep", mesh, comm=c)
    groups = {r.group for r in view.rows}
    assert {"blocks[0,2].w_up", "blocks[1,3].w_up", "blocks[1,3].router"} <= groups
    assert view.comm == c.rows() and any(r["kind"] == "all_to_all" and r["axis"] == "ep" for r in view.comm)
    assert "collectives per step" in view.text() and "all_to_all" in view.text()
    d = view.to_dict()
    assert d["mesh"] == {"dp": 2, "ep": 2} and d["comm"] == c.rows() and len(d["rows"]) == len(view.rows)


def test_missing_names_are_a_clear_error():
    with pytest.raises(ValueError, match=r"no logical names for the parameter at \['b'\].*Fix:"):
        describe({"a": core.random.normal(core.random.key(0), (2,)), "b": core.random.normal(core.random.key(1), (2,))},
                 {"a": ("embed",)}, "dp", Mesh(dp=2))


@pytest.mark.parametrize(("schedule", "stage_sizes", "holders"), [
    ("1f1b", [1, 2], [0, 1, 1]),
    ("1f1b", [2, 1], [0, 0, 1]),
    ("interleaved_1f1b", None, [0, 1, 0, 1]),  # 4 blocks, 2 stages per rank, round robin
])
def test_under_pp_each_block_group_names_the_pp_rank_holding_it(schedule, stage_sizes, holders):
    cfg = dataclasses.replace(CFG, layers=len(holders))
    params, axes, mesh = gpt.init(core.random.key(0), cfg), gpt.axes(cfg), Mesh(dp=2, pp=2)
    plan = shardings.pipeline.plan("dp+pp", mesh, params, schedule=schedule, stage_sizes=stage_sizes,
                                   microbatches=2 if schedule == "1f1b" else 4)
    view = describe(params, axes, "dp+pp", mesh, plan=plan)
    by_block = {}
    for r in view.rows:
        if r.group.startswith("blocks") and r.group.endswith(".wq"):
            for i in r.group[len("blocks["):r.group.index("]")].replace("-", ",").split(","):
                by_block[int(i)] = r.pp_rank
        elif not r.group.startswith("blocks"):
            assert r.pp_rank is None  # embedding, final norm, head: on every pp rank
    assert [by_block[i] for i in range(cfg.layers)] == holders and set(holders) == {0, 1}
    assert view.text().splitlines()[1].endswith("pp rank") and view.to_dict()["rows"][0]["pp_rank"] is None
    assert "pp rank" not in describe(params, axes, "dp", Mesh(dp=2)).text()  # no pipeline, no column
