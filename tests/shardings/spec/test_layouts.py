"""shardings.spec.layouts: presets, composition, early errors, and the layout table of docs/layouts.md as resolved
specs."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

import core
import models
from shardings import Mesh, P, Rules, ShardingError, logical_to_spec
from shardings.spec import layouts
from shardings.step.initialize import param_specs

PRESETS = ("dp", "zero1", "zero2", "zero3", "fsdp", "hsdp", "tp", "sp")
ROLES = ("params", "compute", "grads", "opt_state")

# Representative GPT weights: (path into the params tree, logical names).
CFG = models.gpt.Config(vocab=32, dim=16, layers=1, heads=4, kv_heads=2, mlp=24, seq_len=8)
WEIGHTS = {
    "wq": (("blocks", 0, "wq"), ("embed", "heads", "head_dim")),
    "w_up": (("blocks", 0, "w_up"), ("embed", "mlp")),
    "w_down": (("blocks", 0, "w_down"), ("mlp", "embed")),
    "embed": (("embed",), ("vocab", "embed")),
    "norm": (("final_norm",), ("embed",)),
}
# Activations: the residual stream, the MLP hidden, attention queries, logits; and the batch.
ACTIVATIONS = {
    "residual": ("batch", "seq", "embed"),
    "hidden": ("batch", "seq", "mlp"),
    "q": ("batch", "seq", "heads", "head_dim"),
    "logits": ("batch", "seq", "vocab"),
}
TOKENS = ("batch", "seq")
MESH = Mesh(dp=2, fsdp=1, tp=2)  # a size-1 axis is free: it never shows up in a spec
HSDP_MESH = Mesh(dp=2, fsdp=2)


def _weights(*specs):
    return dict(zip(WEIGHTS, (P(*s) for s in specs), strict=True))


REPLICATED = _weights((), (), (), (), ())


def zero(d):
    """Storage sharded over the data axes ``d``: the embed dim where there is one, else the next rule's."""
    return _weights((d,), (d,), (None, d), (None, d), (d,))


TP = _weights((None, "tp"), (None, "tp"), ("tp",), ("tp",), ())


def zero_tp(d):
    return _weights((d, "tp"), (d, "tp"), ("tp", d), ("tp", d), (d,))


def acts(residual, hidden, q, logits):
    return dict(zip(ACTIVATIONS, (P(*s) for s in (residual, hidden, q, logits)), strict=True))


DP_ACTS = acts(("dp",), ("dp",), ("dp",), ("dp",))
TP_ACTS = acts((), (None, None, "tp"), (None, None, "tp"), (None, None, "tp"))
DP_FSDP = ("dp", "fsdp")
DP_FSDP_ACTS = acts((DP_FSDP,), (DP_FSDP,), (DP_FSDP,), (DP_FSDP,))


def roles(default, **override):
    return {**dict.fromkeys(ROLES, default), **override}


# docs/layouts.md's layout table, one row per layout:
# (layout, mesh, {role: weight specs}, tokens spec, activation specs).
TABLE = [
    ("dp", MESH, roles(REPLICATED), P("dp"), DP_ACTS),
    ("zero1", MESH, roles(REPLICATED, opt_state=zero("dp")), P("dp"), DP_ACTS),
    ("zero2", MESH, roles(REPLICATED, grads=zero("dp"), opt_state=zero("dp")), P("dp"), DP_ACTS),
    ("zero3", MESH, roles(zero("dp"), compute=REPLICATED), P("dp"), DP_ACTS),
    ("fsdp", MESH, roles(zero("dp"), compute=REPLICATED), P("dp"), DP_ACTS),
    # The data presets reduce over every data axis the mesh has ...
    ("zero3", HSDP_MESH, roles(zero(DP_FSDP), compute=REPLICATED), P(DP_FSDP), DP_FSDP_ACTS),
    # ... while hsdp shards over fsdp only and replicates over dp; the batch still spans both.
    ("hsdp", HSDP_MESH, roles(zero("fsdp"), compute=REPLICATED), P(DP_FSDP), DP_FSDP_ACTS),
    ("tp", MESH, roles(TP), P(), TP_ACTS),
    # sp: the residual's seq goes to tp; inside attention/MLP heads and mlp keep tp, so seq stays whole.
    ("tp+sp", MESH, roles(TP), P(), acts((None, "tp"), (None, None, "tp"), (None, None, "tp"), (None, None, "tp"))),
    ("dp+tp", MESH, roles(TP), P("dp"), acts(("dp",), ("dp", None, "tp"), ("dp", None, "tp"), ("dp", None, "tp"))),
    (
        "zero3+tp+sp",
        MESH,
        roles(zero_tp("dp"), compute=TP),
        P("dp"),
        acts(("dp", "tp"), ("dp", None, "tp"), ("dp", None, "tp"), ("dp", None, "tp")),
    ),
]


def _params_like():
    with core.deferred.deferred():  # shapes only: Deferred recipes compute nothing
        return models.gpt.init(core.random.key(0), CFG)


def _at(tree, path):
    for k in path:
        tree = tree[k]
    return tree


@pytest.mark.parametrize(
    ("name", "mesh", "roles", "tokens", "activations"), TABLE, ids=[f"{r[0]}-{r[1]}" for r in TABLE]
)
def test_design_table(name, mesh, roles, tokens, activations):
    layout = layouts.get(name)
    layouts.validate(layout, mesh)
    params, axes = _params_like(), models.gpt.axes(CFG)
    for role, expected in roles.items():
        specs = param_specs(axes, params, layout, mesh, role=role)
        for weight, (path, names) in WEIGHTS.items():
            assert _at(axes, path) == names  # the table's names are the model's
            got = _at(specs, path).normalized()
            assert got == expected[weight].normalized(), (name, role, weight, got)
    assert logical_to_spec(TOKENS, layout.role("batch"), mesh).normalized() == tokens.normalized()
    for act, names in ACTIVATIONS.items():
        got = logical_to_spec(names, layout.activation_rules, mesh).normalized()
        assert got == activations[act].normalized(), (name, act, got)


def test_presets_exist():
    assert set(PRESETS) <= set(layouts.names())
    for name in PRESETS:
        layout = layouts.get(name if name != "sp" else "tp+sp")
        assert isinstance(layout, layouts.Layout)
        assert all(isinstance(layout.role(r), Rules) for r in (*ROLES, "batch", "activations"))
    assert layouts.get("fsdp") == layouts.get("zero3")
    assert layouts.get("ddp") == layouts.get("dp")


# Valid compositions: at most one data strategy, tp optional, sp only with tp.
compositions = (
    st.tuples(
        st.sampled_from((None, "dp", "zero1", "zero2", "zero3", "fsdp", "hsdp")),
        st.sampled_from(((), ("tp",), ("tp", "sp"))),
    )
    .map(lambda c: [p for p in (c[0], *c[1]) if p])
    .filter(bool)
)


@given(compositions, st.randoms(use_true_random=False))
def test_composition_is_order_insensitive(parts, rnd):
    shuffled = list(parts)
    rnd.shuffle(shuffled)
    a, b = layouts.get("+".join(parts)), layouts.get(" + ".join(shuffled))
    assert a == b  # every rule table and the name
    assert layouts.get(shuffled) == a  # a list of names works too
    assert layouts.get(a) is a  # a Layout passes through


def test_composition_is_the_sum_of_its_presets():
    composed = layouts.get("tp+zero3")
    assert composed == layouts.get("zero3+tp")
    assert composed.name == "zero3+tp"
    summed = layouts.get("zero3") + layouts.get("tp")
    for role in (*ROLES, "batch", "activations"):
        assert getattr(composed, role) == getattr(summed, role)
    # the data rules come first: embed takes the data axes before tp's fallbacks are tried
    assert next(iter(composed.params)) == ("embed", ("dp", "fsdp"))


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("zero4", r"unknown layout preset 'zero4' in 'zero4'.*Fix: use presets from"),
        ("zero3+tpp", r"unknown layout preset 'tpp' in 'zero3\+tpp'"),
        ("dp+zero3", r"layout 'dp\+zero3' combines 'dp' and 'zero3', two data strategies.*Fix: keep one"),
        ("zero1+hsdp+tp", r"combines 'zero1' and 'hsdp'"),
        ("tp+tp", r"combines 'tp' and 'tp'"),
        ("sp", r"layout 'sp': preset 'sp' only works together with 'tp'.*Fix: write 'sp\+tp'"),
        ("zero3+sp", r"preset 'sp' only works together with 'tp'"),
    ],
)
def test_get_errors(spec, match):
    with pytest.raises(ShardingError, match=match):
        layouts.get(spec)


@pytest.mark.parametrize(
    ("spec", "mesh", "match"),
    [
        ("tp", Mesh(dp=4), r"Mesh\(dp=4\): layout 'tp': preset 'tp' needs a mesh axis tp, but the mesh has \('dp',\)"),
        ("zero3+tp+sp", Mesh(dp=4), r"layout 'zero3\+tp\+sp': preset 'tp' needs a mesh axis tp.*\('dp',\)"),
        ("hsdp", Mesh(dp=4), r"layout 'hsdp': preset 'hsdp' needs a mesh axis fsdp, but the mesh has \('dp',\)"),
        ("hsdp+tp", Mesh(dp=2, tp=2), r"preset 'hsdp' needs a mesh axis fsdp, but the mesh has \('dp', 'tp'\)"),
        ("zero3+tp", Mesh(tp=4), r"preset 'zero3' needs a mesh axis 'dp' or 'fsdp', but the mesh has \('tp',\)"),
    ],
)
def test_validate_errors_name_layout_preset_and_mesh(spec, mesh, match):
    with pytest.raises(ShardingError, match=match) as e:
        layouts.validate(layouts.get(spec), mesh)
    assert "Fix: add the axis to the mesh" in str(e.value)


@pytest.mark.parametrize(
    ("spec", "mesh"),
    [("dp", Mesh(dp=4)), ("zero3", Mesh(fsdp=4)), ("hsdp", Mesh(dp=2, fsdp=2)), ("zero2+tp+sp", Mesh(dp=2, tp=2))],
)
def test_validate_accepts(spec, mesh):
    layouts.validate(layouts.get(spec), mesh)


def test_unknown_role():
    with pytest.raises(ValueError, match="unknown layout role 'weights'"):
        layouts.get("dp").role("weights")


def test_every_role_resolves_every_logical_name():
    layout = layouts.get("zero3+tp+sp")
    mesh = Mesh(dp=2, tp=2)
    for role in (*ROLES, "batch", "activations"):
        for name in layouts.LOGICAL_NAMES:
            logical_to_spec((name,), layout.role(role), mesh)  # no "has no rule" error


@pytest.fixture
def own_registry(monkeypatch):
    """Register into a copy of the preset table, restored after the test."""
    monkeypatch.setattr(layouts, "_PRESETS", dict(layouts._PRESETS))


def test_register_a_user_preset(own_registry):
    mlp_only = Rules(mlp="tp")  # a user's tensor parallelism that splits only the MLP
    layouts.register(
        "mlp_tp",
        layouts.Layout(params=mlp_only, compute=mlp_only, grads=mlp_only, opt_state=mlp_only, activations=mlp_only),
        group="tp",
        needs=(("tp",),),
        tier="tensor",
    )
    assert "mlp_tp" in layouts.names()
    layout = layouts.get("mlp_tp+zero3")
    assert layout == layouts.get("zero3+mlp_tp") and layout.name == "zero3+mlp_tp"
    mesh = Mesh(dp=2, tp=2)
    specs = param_specs(models.gpt.axes(CFG), _params_like(), layout, mesh)
    assert specs["blocks"][0]["w_up"].normalized() == P("dp", "tp")
    assert specs["blocks"][0]["wq"].normalized() == P("dp")  # heads stay whole: only mlp goes to tp
    with pytest.raises(ShardingError, match="combines 'tp' and 'mlp_tp', two tp strategies"):
        layouts.get("tp+mlp_tp")
    with pytest.raises(ShardingError, match="preset 'mlp_tp' needs a mesh axis tp"):
        layouts.validate(layouts.get("mlp_tp"), Mesh(dp=4))
