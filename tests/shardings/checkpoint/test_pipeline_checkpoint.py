"""checkpoint under pp: a train state saved from a pipelined step (params and optimizer state as DTensors on the
stage mesh) loads bitwise under other layouts and on one device, a data-parallel one loads under pp, and a run
resumed under pp continues exactly as the run that never stopped (simulated ranks)."""

import pytest
import torch
from torch.distributed.tensor import DTensor

import core
import models.gpt as gpt
import shardings
from core import tree
from shardings import Mesh, checkpoint

CFG = gpt.Config(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, mlp=64, seq_len=8)  # 2 blocks: one per stage
OPT = core.optim.adamw(1e-2, weight_decay=0.1)
PP = ("dp+pp", Mesh(dp=2, pp=2))
# Built here, not inside simulate(), where a random op draws one stream per rank.
BATCHES = [gpt.example_batch(CFG, 8, seed=i) for i in range(2)]


def train_state(layout=None, mesh=None, steps=0):
    """``(state, step_fn)`` after ``steps`` AdamW steps under ``layout`` on ``mesh`` (the model's stages as the loss
    under pp, 2 microbatches), or on one device (``step_fn`` None)."""
    key = core.random.key(0)
    if mesh is None:
        params = gpt.init(key, CFG)
        assert steps == 0
        return {"params": params, "opt_state": OPT.init(params), "data": {"position": 0}}, None
    params = shardings.init(gpt.init, key, CFG, axes=gpt.axes(CFG), layout=layout, mesh=mesh)
    plan = shardings.pipeline.plan_for(layout, mesh, params, microbatches=2)  # None without pp
    step_fn = shardings.train_step(gpt.stages(CFG), OPT, layout=layout, mesh=mesh, plan=plan, accum_steps=2)
    opt_state = step_fn.init(params)
    for i in range(steps):
        params, opt_state, _ = step_fn(params, opt_state, BATCHES[i])
    return {"params": params, "opt_state": opt_state, "data": {"position": 8 * steps}}, step_fn


def full_values(state):
    """``{key path: whole tensor or value}``: what a state holds, whatever its layout."""
    whole = shardings.gather(state)
    return {tree.keystr(p): shardings.unwrap(x) for p, x in tree.leaves_with_path(whole)}


def assert_bitwise(got, want):
    assert got.keys() == want.keys()
    for path, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[path].dtype == value.dtype and torch.equal(got[path], value), path
        else:
            assert got[path] == value, path


def placed_like(state, like):
    """Every DTensor of ``state`` is on ``like``'s mesh with ``like``'s placements."""
    for a, b in zip(tree.leaves(state), tree.leaves(like)):
        assert isinstance(a, DTensor) == isinstance(b, DTensor)
        if isinstance(b, DTensor):
            assert a.device_mesh == b.device_mesh and a.placements == b.placements
    return True


@pytest.fixture(scope="module")
def saved_under_pp(tmp_path_factory):
    """A dp+pp checkpoint (Mesh(dp=2, pp=2), after one step) and the values it holds."""
    root = tmp_path_factory.mktemp("pp")
    with shardings.simulate(4):
        source, _ = train_state(*PP, steps=1)
        assert source["params"]["embed"].device_mesh.mesh_dim_names == ("dp",)  # the stage mesh
        checkpoint.save(root, source, step=1)
        values = full_values(source)
    assert values["['params']['embed']"].abs().sum() > 0 and values["['opt_state'][0].count"] == 1
    return root, values


@pytest.mark.parametrize(("layout", "sizes"), [("dp", {"dp": 4}), ("zero3+tp", {"dp": 2, "tp": 2}),
                                               ("tp+sp+pp", {"pp": 2, "tp": 2})])
def test_a_pp_checkpoint_loads_bitwise_under_other_layouts(saved_under_pp, layout, sizes):
    root, want = saved_under_pp
    with shardings.simulate(4):
        like, _ = train_state(layout, Mesh(sizes))
        state, step = checkpoint.load(root, like)
        assert step == 1 and placed_like(state, like)
        assert_bitwise(full_values(state), want)


def test_a_pp_checkpoint_loads_bitwise_on_one_device_and_back(saved_under_pp, tmp_path):
    root, want = saved_under_pp
    like, _ = train_state()
    single, _ = checkpoint.load(root, like)
    assert not isinstance(single["params"]["embed"], DTensor)
    assert_bitwise(full_values(single), want)
    checkpoint.save(tmp_path, single, step=1)  # one device → pp
    with shardings.simulate(4):
        like, _ = train_state(*PP)
        state, _ = checkpoint.load(tmp_path, like)
        assert placed_like(state, like)
        assert_bitwise(full_values(state), want)


def test_a_dp_checkpoint_loads_bitwise_under_pp(tmp_path):
    with shardings.simulate(4):
        source, _ = train_state("dp", Mesh(dp=4), steps=1)
        checkpoint.save(tmp_path, source, step=1)
        like, _ = train_state(*PP)
        state, _ = checkpoint.load(tmp_path, like)
        assert placed_like(state, like)
        assert_bitwise(full_values(state), full_values(source))


def test_resuming_under_pp_continues_exactly_as_without_the_checkpoint(saved_under_pp):
    root, _ = saved_under_pp
    with shardings.simulate(4):
        going, step_fn = train_state(*PP, steps=1)
        fresh, _ = train_state(*PP)
        resumed, _ = checkpoint.load(root, fresh)
        results = []
        for state in (going, resumed):
            params, opt_state, metrics = step_fn(state["params"], state["opt_state"], BATCHES[1])
            results.append(full_values({"params": params, "opt_state": opt_state, "loss": metrics["loss"]}))
    assert_bitwise(results[1], results[0])
