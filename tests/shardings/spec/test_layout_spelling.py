"""One spelling everywhere: any order of a composition, layout strings in ``use``, typos and a missing process group."""

import functools

import pytest
import torch

import core
import models.mlp as mlp
import shardings
from shardings import Mesh, P, Rules
from shardings.spec import layouts

CFG = mlp.Config(vocab=32, dim=16, mlp=32, layers=2, seq_len=8)


@pytest.mark.parametrize(("spelling", "canonical"), [
    ("sp+tp", "tp+sp"), ("tp+zero3+sp", "zero3+tp+sp"), ("sp + tp + fsdp", "zero3+tp+sp"), ("tp+ep+dp", "ep+dp+tp"),
])
def test_any_order_of_a_valid_composition_is_the_same_layout(spelling, canonical):
    assert layouts.get(spelling) == layouts.get(canonical)
    assert layouts.get(spelling).name == canonical


def test_use_takes_a_layout_string_like_train_step():
    mesh = Mesh(dp=2, tp=2)
    x = torch.arange(64.0).reshape(4, 4, 4)
    with shardings.simulate(mesh.size):
        with shardings.use(mesh, "dp"):
            assert shardings.constrain(x, ("batch", "seq", "embed")).placements == shardings.shard(
                x, P("dp"), mesh).placements
        with shardings.use(mesh, "sp+tp"):
            assert shardings.current().rules == layouts.get("tp+sp").activation_rules
    with pytest.raises(ValueError, match="unknown layout preset 'dpp'"), shardings.use(mesh, "dpp"):
        pass


def test_a_rule_naming_an_axis_no_mesh_or_preset_knows_is_an_error():
    with pytest.raises(shardings.ShardingError, match=r"'dpp'.*neither the mesh \(axes \('dp',\)\)"):
        shardings.logical_to_spec(("batch", "embed"), Rules(batch="dpp", embed=None), Mesh(dp=2))
    with (pytest.raises(shardings.ShardingError, match=r"'dpp'"), shardings.simulate(2),
          shardings.use(Mesh(dp=2), Rules(batch="dpp", embed=None))):
        shardings.constrain(torch.zeros(2, 4), ("batch", "embed"))


def test_presets_still_skip_the_axes_a_mesh_lacks():
    # zero3's rules name dp and fsdp, tp's tp: on Mesh(dp=2) only dp is used, silently.
    rules = layouts.get("zero3+tp").role("params")
    assert shardings.logical_to_spec(("embed", "mlp"), rules, Mesh(dp=2)) == P("dp", None)
    # A user's table whose axes a preset knows is skipped the same way (one table for every mesh).
    mine = Rules(batch=("dp", "fsdp"), mlp="tp")
    assert shardings.logical_to_spec(("batch", "mlp"), mine, Mesh(dp=2)) == P("dp", None)


def test_a_sharded_call_without_a_process_group_says_what_to_do():
    mesh = Mesh(dp=2)
    fix = r"no process group is running.*Fix: run inside `with shardings.simulate\(2\):`"
    with pytest.raises(RuntimeError, match=fix):
        shardings.init(mlp.init, core.random.key(0), CFG, axes=mlp.axes(CFG), layout="zero3", mesh=mesh)
    step = shardings.train_step(functools.partial(mlp.loss, cfg=CFG), core.optim.sgd(0.1), layout="dp", mesh=mesh,
                                axes=mlp.axes(CFG))
    params = mlp.init(core.random.key(0), CFG)
    with pytest.raises(RuntimeError, match=fix):
        step(params, None, mlp.example_batch(CFG, 2))
