"""shardings.spec.presets: the cp, cp_allgather and ep presets resolved to specs, as test_layouts' design table.

Equivalence cannot see these rules go wrong: an ep that stops splitting tokens, or experts left whole, still
trains like one device (ranks repeat each other's work), and so does cp with K/V all-gathered instead of
ringed. The drill's mutants ``ep-ranks-after-data`` and ``cp-kv-seq-replicated`` (tests/mutants.py) are such
rule changes; here they fail in milliseconds, without running a step.
"""

import pytest

from shardings import Mesh, P, Rules, ShardingError, logical_to_spec
from shardings.spec import layouts

TOKENS = ("batch", "seq")
EXPERT_W = ("expert", "embed", "mlp")  # models.moe's w_gate / w_up
DENSE_W = ("embed", "mlp")  # a dense block's w_up
KV = ("batch", "kv_seq", "kv_heads", "head_dim")  # K/V as attention consumes them
ROLES = ("params", "compute", "grads", "opt_state")

DP2_EP2 = Mesh(dp=2, ep=2)
EP_TABLE = [
    # (layout, mesh, tokens, expert weights per role, a dense weight's storage)
    ("ep", Mesh(ep=2), P("ep"), dict.fromkeys(ROLES, P("ep")), P()),
    # ep is a data axis for tokens (after dp), never for ZeRO's sharding of dense weights
    ("dp+ep", DP2_EP2, P(("dp", "ep")), dict.fromkeys(ROLES, P("ep")), P()),
    ("zero3+ep", DP2_EP2, P(("dp", "ep")), {**dict.fromkeys(ROLES, P("ep", "dp")), "compute": P("ep")}, P("dp")),
    # ep's expert -> ep beats tp's expert -> None; the experts' hidden dim stays on tp
    ("tp+ep", Mesh(tp=2, ep=2), P("ep"), dict.fromkeys(ROLES, P("ep", None, "tp")), P(None, "tp")),
    ("dp+tp+ep", Mesh(dp=2, tp=2, ep=2), P(("dp", "ep")), dict.fromkeys(ROLES, P("ep", None, "tp")), P(None, "tp")),
]


@pytest.mark.parametrize(("name", "mesh", "tokens", "expert", "dense"), EP_TABLE, ids=[r[0] for r in EP_TABLE])
def test_ep_splits_tokens_over_ep_and_experts_in_every_role(name, mesh, tokens, expert, dense):
    layout = layouts.get(name)
    layouts.validate(layout, mesh)
    assert logical_to_spec(TOKENS, layout.role("batch"), mesh).normalized() == tokens.normalized()
    for role, want in expert.items():
        assert logical_to_spec(EXPERT_W, layout.role(role), mesh).normalized() == want.normalized(), role
    assert logical_to_spec(DENSE_W, layout.role("params"), mesh).normalized() == dense.normalized()


@pytest.mark.parametrize(("name", "kv"), [("cp", P(None, "cp")), ("cp_allgather", P())])
def test_cp_rings_kv_and_cp_allgather_gathers_them(name, kv):
    layout, mesh = layouts.get(name), Mesh(dp=2, cp=2)
    assert logical_to_spec(TOKENS, layout.role("batch"), mesh).normalized() == P(None, "cp")
    assert logical_to_spec(KV, layout.activation_rules, mesh).normalized() == kv.normalized()


@pytest.fixture
def own_registry(monkeypatch):
    """Register into a copy of the preset table, restored after the test."""
    monkeypatch.setattr(layouts, "_PRESETS", dict(layouts._PRESETS))


def test_a_layout_carries_its_presets_in_canonical_order_and_whether_it_pipelines():
    layout = layouts.get("pp+sp+tp+fsdp")
    assert layout.presets == ("zero3", "tp", "sp", "pp") and layout.pipelined
    assert layout.name == "zero3+tp+sp+pp"  # for display: derived from the presets
    assert not layouts.get("zero3+tp+sp").pipelined
    assert layouts.Layout().presets == () and layouts.Layout().name == "" and not layouts.Layout().pipelined


def test_every_preset_has_a_named_tier_and_a_composition_follows_the_tiers():
    for name in layouts.names(aliases=False):
        assert layouts.preset(name).tier in layouts.TIERS, name
    tiers = [layouts.TIERS.index(layouts.preset(p).tier) for p in layouts.get("pp+sp+cp+tp+dp+ep").presets]
    assert tiers == sorted(tiers)


def test_a_typo_names_the_nearest_preset():
    with pytest.raises(ShardingError, match=r"unknown layout preset 'zer03' in 'dp\+zer03' \(did you mean 'zero3'\?\)"
                                            r".*Fix: use presets from"):
        layouts.get("dp+zer03")


def test_the_registry_says_what_runs_inside_pipeline_stages():
    with pytest.raises(ShardingError, match=r"pp does not compose with \['offload_optimizer'\] yet.*Fix: use pp with"):
        layouts.get("dp+offload_optimizer+pp")
    assert all(layouts.preset(p).composes_with_pp for p in layouts.get("ep+hsdp+tp+sp+cp").presets)


def test_pipelining_is_a_registered_flag_not_a_name(own_registry):
    layouts.register("app", layouts.Layout(activations=Rules(mlp="tp")), group="app", tier="tensor",
                     composes_with_pp=True)  # "pp" in its name, and no pipeline
    layouts.register("stages", layouts.Layout(), group="stages", tier="pipeline", pipeline=True)
    assert not layouts.get("dp+app").pipelined
    assert layouts.get("stages+dp+app").pipelined and layouts.get("stages+dp+app").presets == ("dp", "app", "stages")


def test_an_integer_rank_still_registers_at_the_tier_it_meant(own_registry):
    with pytest.warns(DeprecationWarning, match="rank= is deprecated"):
        layouts.register("mlp_tp", layouts.Layout(compute=Rules(mlp="tp")), group="tp", needs=(("tp",),), rank=10)
    assert layouts.preset("mlp_tp").tier == "tensor"
