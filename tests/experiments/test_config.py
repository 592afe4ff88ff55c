"""Every config group member composes and builds; impossible combinations give one clear error."""


import pytest
from hydra.core.config_store import ConfigStore

import models
from experiments.build import ConfigError, build, optimizer
from experiments.config import MESHES, MODELS, register
from shardings import layouts

register()


def _members(group: str) -> list[str]:
    return sorted(n.removesuffix(".yaml") for n in ConfigStore.instance().list(group))


def test_groups_hold_the_documented_members():
    assert _members("model") == sorted(MODELS)
    assert _members("mesh") == sorted(MESHES)
    assert _members("runtime") == ["multiprocess", "simulate", "torchrun"]
    assert "layout" not in ConfigStore.instance().repo  # a plain string field: no members enumerated


@pytest.mark.parametrize("model", sorted(MODELS))
def test_model_members(compose_train, model):
    cfg = compose_train(f"model={model}", "runtime=simulate")
    setup = build(cfg)
    assert setup.model is models.get(MODELS[model][0])
    assert setup.layout.name == "zero3+tp" and setup.mesh.shape == {"dp": 2, "tp": 2}


def test_layout_is_a_string_any_preset_or_composition_resolved_at_build(compose_train):
    # every preset (and alias) alone on a mesh with every axis a preset can need; sp alone needs tp
    every_axis = ("mesh=dp2_fsdp2_tp2", "++mesh.sizes.cp=2", "++mesh.sizes.ep=2", "++mesh.sizes.pp=2",
                  "runtime=simulate")  # layouts with pp train on simulated ranks only
    cfg = compose_train("layout=sp+tp+fsdp", *every_axis)
    assert cfg.layout == "sp+tp+fsdp" and build(cfg).layout == layouts.get("zero3+tp+sp")
    for name in layouts.names():
        cfg.layout = name
        if name == "sp":
            with pytest.raises(ConfigError, match="preset 'sp' only works together with 'tp'"):
                build(cfg)
            continue
        assert build(cfg).layout == layouts.get(name)
    cfg.layout = "offload_optimizer+dp+pp"
    with pytest.raises(ConfigError, match=r"pp does not compose with \['offload_optimizer'\]"):
        build(cfg)


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_mesh_members(compose_train, mesh):
    axes = set(MESHES[mesh])
    layout = "dp" if {"dp", "fsdp"} & axes else "pp" if "pp" in axes else "tp"
    pp = ["runtime=simulate", "model.config.layers=4"] if layout == "pp" else []  # pp4: a block per stage
    assert build(compose_train(f"mesh={mesh}", f"layout={layout}", *pp)).mesh.shape == MESHES[mesh]


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
@pytest.mark.parametrize("data", ["stdlib", "random"])
@pytest.mark.parametrize("runtime", ["simulate", "multiprocess", "torchrun"])
def test_optim_data_runtime_members(compose_train, optim, data, runtime):
    cfg = compose_train(f"optim={optim}", f"data={data}", f"runtime={runtime}")
    build(cfg)
    assert cfg.runtime.kind == runtime and cfg.data.source == data
    assert callable(optimizer(cfg.optim, cfg.steps).update)


def test_default_is_the_documented_run(compose_train):
    cfg = compose_train()
    setup = build(cfg)
    assert (cfg.model.name, setup.layout.name, setup.mesh.shape) == ("gpt", "zero3+tp", {"dp": 2, "tp": 2})
    assert (cfg.runtime.kind, cfg.data.source) == ("multiprocess", "stdlib")


IMPOSSIBLE = [
    (["layout=tp", "mesh=dp4"], r"preset 'tp' needs a mesh axis tp"),
    (["layout=hsdp", "mesh=dp4"], r"preset 'hsdp' needs a mesh axis fsdp"),
    (["runtime.world_size=8"], r"has 4 ranks but the runtime has 8"),
    (["model.config.dim=96", "model.config.heads=6", "layout=tp", "mesh=tp4"],
     r"'heads' has size 6, not divisible by 4"),
    (["layout=dp", "mesh=dp4", "data.batch_size=6"], r"batch size=6 is not divisible by 4"),
    (["layout=dp", "mesh=dp4", "accum_steps=3"], r"batch size=16 is not divisible by 12"),
    (["layout=tp+sp", "mesh=tp4", "data.seq_len=62"], r"seq_len=62 is not divisible by 4"),
    (["model.config.heads=3"], r"model.config: .*dim=64 is not divisible by heads=3"),
    (["+model.config.expert_count=4"], r"set only fields of gpt.Config"),
    (["runtime.kind=mpi"], r"runtime.kind='mpi' is unknown"),
    (["layout=dp+zer03"], r"layout=dp\+zer03 .*unknown layout preset 'zer03' .*\(did you mean 'zero3'\?\)"
                          r".*presets from \('dp', 'zero1'"),
]


@pytest.mark.parametrize(("overrides", "message"), IMPOSSIBLE)
def test_impossible_combinations_fail_at_build(compose_train, overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        build(compose_train(*overrides))
    assert "Fix:" in str(info.value)


def test_jit_true_gives_the_train_step_the_models_stages_to_compile_block_by_block(compose_train):
    from experiments.build import loss
    from shardings.pipeline import Stages

    cfg = compose_train("jit=true", "layout=zero3", "mesh=dp4", "runtime=simulate")
    setup = build(cfg)
    assert cfg.jit is True and isinstance(loss(setup, cfg.jit), Stages)
    assert not isinstance(loss(setup), Stages)  # eager: the model's loss, as before
