"""The search space comes from the registries: every valid composition, meshes over the axes its presets use."""

import itertools

import models
import shardings
from shardings.planner import Candidate, Space, enumerate_candidates
from shardings.planner.candidates import compositions
from shardings.spec import layouts
from shardings.spec.layouts import Layout
from shardings.spec.rules import Rules

CFG = models.gpt.Config(vocab=64, dim=32, layers=4, heads=4, kv_heads=2, mlp=64, seq_len=16)


def _world(c: Candidate) -> int:
    n = 1
    for size in c.sizes.values():
        n *= size
    return n


def test_every_candidate_is_a_valid_layout_on_a_mesh_of_the_world_with_the_axes_it_uses():
    cands = enumerate_candidates(8, CFG, 8, 16, per_node=4, space=Space(precisions=("fp32", "bf16")))
    assert cands and len(set(cands)) == len(cands)
    for c in cands:
        layout = layouts.get(c.layout)
        assert layout.name == c.layout and _world(c) == 8
        layouts.validate(layout, shardings.Mesh(c.sizes))  # the axes its presets need are there
        assert all(n >= 2 for n in c.sizes.values())  # no axis that would only replicate
        assert c.size("tp") <= 4 and CFG.n_kv_heads % c.size("tp") == 0  # within a node, heads split evenly
        assert c.pipelined == layout.pipelined
        if c.pipelined:
            assert c.microbatches >= c.size("pp") and c.schedule in shardings.pipeline.SCHEDULES
    assert {c.precision for c in cands} == {"fp32", "bf16"} and {c.remat for c in cands} == {False, True}


def test_the_compositions_are_the_registry_s_with_at_most_one_preset_per_group():
    found = {lay.name for lay in compositions()}
    groups: dict[str, list[str]] = {}
    for name in layouts.names(aliases=False):
        groups.setdefault(layouts.preset(name).group, []).append(name)
    expected = set()
    for choice in itertools.product(*[[None, *m] for m in groups.values()]):
        if not any(choice):
            continue
        try:
            expected.add(layouts.get([p for p in choice if p]).name)
        except ValueError:
            continue
    assert found == expected
    assert {"zero3+tp+sp", "hsdp+tp", "zero2+offload_optimizer", "dp+tp+pp", "ep"} <= found


def test_a_preset_registered_later_is_a_candidate():
    layouts.register("mlp_only_tp", Layout(params=Rules([("mlp", "tp")]), compute=Rules([("mlp", "tp")]),
                                           grads=Rules([("mlp", "tp")]), opt_state=Rules([("mlp", "tp")])),
                     group="mlp_only_tp", needs=(("tp",),), tier="tensor")
    try:
        compositions.cache_clear()
        cands = enumerate_candidates(4, CFG, 8, 16, per_node=4, space=Space(remat=(False,)))
        assert any("mlp_only_tp" in c.layout.split("+") for c in cands)
    finally:
        layouts._PRESETS.pop("mlp_only_tp")
        compositions.cache_clear()


def test_hsdp_has_a_replica_axis_and_pipelines_fit_the_blocks():
    cands = enumerate_candidates(8, CFG, 16, 16, per_node=8, space=Space(remat=(False,)))
    hsdp = [c for c in cands if c.layout.startswith("hsdp")]
    assert hsdp and all(c.size("dp") >= 2 and c.size("fsdp") >= 2 for c in hsdp)
    assert all(c.size("pp") * (c.virtual_stages or 1) <= CFG.layers for c in cands if c.pipelined)
    assert not any(c.size("ep") > 1 for c in cands)  # not an MoE model


def test_a_candidate_prints_as_the_rows_show_it():
    c = Candidate("zero1+tp+pp", (("pp", 2), ("dp", 2), ("tp", 2)), 8, "interleaved_1f1b", 2, True, "bf16")
    assert c.mesh_name == "pp2_dp2_tp2" and not hasattr(c, "overrides")  # the app's keys: experiments.auto
    assert str(c) == "zero1+tp+pp pp2_dp2_tp2 interleaved_1f1b v2 m8 remat bf16"
