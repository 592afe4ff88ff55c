import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core import tree
from shardings import Mesh, P, Rules, ShardingError, annotate, logical_to_spec, logical_to_specs
from shardings.spec.mesh import validate_spec
from shardings.spec.rules import is_names, path_str

AXES = ("dp", "fsdp", "tp", "cp")  # "cp" is never in the generated meshes: an absent axis (a preset's, so skipped)
NAMES = ("batch", "seq", "embed", "mlp", "heads")

targets = st.one_of(
    st.none(),
    st.sampled_from(AXES),
    st.lists(st.sampled_from(AXES), min_size=2, max_size=2, unique=True).map(tuple),
)
rule_tables = st.lists(st.tuples(st.sampled_from(NAMES), targets), min_size=1, max_size=8).map(Rules)
meshes = st.dictionaries(st.sampled_from(AXES[:3]), st.integers(1, 3), min_size=1, max_size=3).map(Mesh)


@st.composite
def cases(draw):
    rules = draw(rule_tables)
    names = draw(st.lists(st.sampled_from((None, *rules.names)), max_size=4).map(tuple))
    return rules, names, draw(meshes)


def _raw(names, rules):
    """The mesh-independent resolution: every axis present with size 2, so nothing is dropped."""
    return logical_to_spec(names, rules, Mesh(dict.fromkeys(AXES, 2)))


# Pure Python and microseconds per case: many examples, so that contested axes come up often.
@settings(max_examples=200)
@given(cases())
def test_flax_semantics(case):
    rules, names, _ = case
    raw = _raw(names, rules).dim_axes()
    table = list(rules)
    assert len(raw) == len(names)
    assert len(set(a for axes in raw for a in axes)) == sum(map(len, raw)), "an axis shards two dims"

    def axes_of(target):
        return P(target).dim_axes()[0]

    # The rule each dim took: the first rule for its name with the target it got (None: no rule took it).
    took = [
        next((i for i, (n, t) in enumerate(table) if n == name and axes_of(t) == raw[d]), None)
        if name is not None
        else None
        for d, name in enumerate(names)
    ]
    for d, name in enumerate(names):
        if name is None:
            assert raw[d] == ()
            continue
        assert took[d] is not None or raw[d] == ()
        # Every earlier rule for this name was blocked: another dim, assigned no later in table order,
        # already held one of its axes.
        stop = len(table) if took[d] is None else took[d]
        for i, (n, t) in enumerate(table[:stop]):
            if n == name:
                blockers = [e for e in range(len(names)) if e != d and took[e] is not None and took[e] <= i]
                assert any(set(axes_of(t)) & set(raw[e]) for e in blockers), (d, i, table, names, raw)


@settings(max_examples=100)
@given(cases())
def test_size1_and_absent_axes_dropped(case):
    rules, names, mesh = case
    spec = logical_to_spec(names, rules, mesh)
    assert validate_spec(spec, mesh, (1,) * len(names)) == spec
    assert len(spec) == len(names)
    assert all(mesh.shape[a] > 1 for a in spec.axes)
    expected = [tuple(a for a in axes if mesh.shape.get(a, 1) > 1) for axes in _raw(names, rules).dim_axes()]
    assert [tuple(axes) for axes in spec.dim_axes()] == expected


FALLBACK = Rules([("embed", "fsdp"), ("mlp", "fsdp"), ("mlp", "tp")])


@pytest.mark.parametrize(
    ("names", "mesh", "expected"),
    [
        (("embed", "mlp"), Mesh(fsdp=2, tp=2), P("fsdp", "tp")),
        (("mlp", "embed"), Mesh(fsdp=2, tp=2), P("tp", "fsdp")),  # the earlier rule wins the contested axis
        (("mlp",), Mesh(fsdp=2, tp=2), P("fsdp")),
        (("embed", "mlp"), Mesh(fsdp=1, tp=2), P(None, "tp")),  # size-1 axis dropped after resolution
        (("embed", "mlp"), Mesh(tp=4), P(None, "tp")),  # absent axis dropped too
        (("embed", None, "mlp"), Mesh(fsdp=2, tp=2), P("fsdp", None, "tp")),
        ((), Mesh(fsdp=2), P()),
    ],
)
def test_fallback_cases(names, mesh, expected):
    assert logical_to_spec(names, FALLBACK, mesh) == expected


def test_tuples_none_rules_and_repeated_names():
    rules = Rules(batch=("dp", "fsdp"), embed=None) + Rules([("heads", "tp"), ("heads", None)])
    mesh = Mesh(dp=2, fsdp=2, tp=2)
    assert logical_to_spec(("batch", "embed"), rules, mesh) == P(("dp", "fsdp"), None)
    assert logical_to_spec(("batch",), rules, Mesh(dp=2, fsdp=1, tp=4)) == P("dp")
    assert logical_to_spec(("heads", "heads"), rules, mesh) == P("tp", None)
    assert logical_to_spec(("embed", "embed"), rules, mesh) == P(None, None)


def test_missing_rule_error_names_everything():
    with pytest.raises(ShardingError) as e:
        logical_to_spec(("batch", "vocab"), Rules(batch="dp"), Mesh(dp=2), path="['lm_head']")
    msg = str(e.value)
    for part in ("'vocab'", "('batch', 'vocab')", "the rules name ['batch']", "Mesh(dp=2)", "lm_head", "Fix:"):
        assert part in msg
    assert msg.endswith(".") and "Rules([" not in msg  # the names, not the whole table


@pytest.mark.parametrize(("names", "rules", "unknown", "meant"), [
    (("embed", "mpl"), Rules(embed=None, mlp="tp"), "mpl", "mlp"),  # a typo in the model's axes
    (("embed", "mlp"), Rules(embed=None, mpl="tp"), "mlp", "mpl"),  # a typo in the Rules table
])
def test_a_misspelled_logical_name_gets_did_you_mean(names, rules, unknown, meant):
    with pytest.raises(ShardingError) as e:
        logical_to_spec(names, rules, Mesh(tp=2), path="['blocks'][0]['w_up']")
    msg = str(e.value)
    assert msg.startswith("at ['blocks'][0]['w_up'], mesh Mesh(tp=2): ")
    assert f"unknown logical name {unknown!r} (of the names {names}): did you mean {meant!r}?" in msg
    assert "Fix: write" in msg and "Rules([" not in msg


@pytest.mark.parametrize("names", ["batch", P("dp"), ("batch", 3), 5])
def test_bad_names(names):
    with pytest.raises(TypeError, match="Fix:"):
        logical_to_spec(names, Rules(batch="dp"), Mesh(dp=2))


def test_rules_must_be_rules():
    with pytest.raises(TypeError, match=r"expected shardings\.Rules.*Fix:"):
        logical_to_spec(("batch",), {"batch": "dp"}, Mesh(dp=2))


def test_rules_are_immutable_composable_data():
    a = Rules([("batch", ("dp", "fsdp")), ("embed", "fsdp"), ("embed", None)])
    assert Rules({"batch": ["dp", "fsdp"]}) == Rules(batch=("dp", "fsdp")) == Rules([("batch", ("dp", "fsdp"))])
    assert repr(a) == "Rules([('batch', ('dp', 'fsdp')), ('embed', 'fsdp'), ('embed', None)])"
    assert eval(repr(a)) == a and hash(eval(repr(a))) == hash(a)
    assert pickle.loads(pickle.dumps(a)) == a
    assert a.names == ("batch", "embed") and a.targets("embed") == ("fsdp", None) and a.targets("x") == ()
    b = Rules(mlp="tp", embed="tp")
    assert list(a + b) == [*a, *b] and len(a + b) == 5
    assert (a + b).targets("embed") == ("fsdp", None, "tp")
    assert a.replace(embed="tp", mlp=None) == Rules([("batch", ("dp", "fsdp")), ("embed", "tp"), ("mlp", None)])
    assert a.targets("embed") == ("fsdp", None)  # unchanged
    assert Rules(batch=("dp",), embed=()) == Rules(batch="dp", embed=None)  # canonical targets
    with pytest.raises(AttributeError):
        a._table = ()


@pytest.mark.parametrize("bad", [[("batch",)], [("batch", 3)], [(3, "dp")], ["batch"], [("", "dp")]])
def test_bad_rules(bad):
    with pytest.raises(TypeError, match="Fix:"):
        Rules(bad)


def test_rule_with_repeated_axis():
    with pytest.raises(ShardingError, match="twice"):
        Rules(batch=("dp", "dp"))


def test_logical_to_specs_maps_a_names_tree():
    names = {"blocks": [{"w": ("embed", "mlp"), "b": ("mlp",)}], "scale": ()}
    specs = logical_to_specs(names, Rules(embed="fsdp", mlp="tp"), Mesh(fsdp=2, tp=2))
    assert specs == {"blocks": [{"w": P("fsdp", "tp"), "b": P("tp")}], "scale": P()}
    with pytest.raises(ShardingError, match=r"\['blocks'\]\[0\]\['w'\]"):
        logical_to_specs(names, Rules(mlp="tp"), Mesh(tp=2))
    assert is_names(("a", None)) and is_names(()) and not is_names(P("dp")) and not is_names(("a", 1))


HF = {
    "model.embed_tokens.weight": torch.zeros(32, 8),
    "model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 8),
    "model.layers.0.self_attn.o_proj.weight": torch.zeros(8, 8),
    "model.layers.0.mlp.up_proj.weight": torch.zeros(16, 8),
    "model.layers.0.input_layernorm.weight": torch.zeros(8),
    "model.norm.weight": torch.zeros(8),
    "lm_head.weight": torch.zeros(32, 8),
}
HF_PATTERNS = {
    r"embed_tokens": ("vocab", "embed"),
    r"q_proj\.weight$": ("heads", "embed"),
    r"o_proj\.weight$": ("embed", "heads"),
    r"(up|gate)_proj\.weight$": ("mlp", "embed"),
    r"norm\.weight$": ("embed",),
    r"^lm_head": ("vocab", "embed"),
}


def test_annotate_hf_state_dict():
    names = annotate(HF, HF_PATTERNS)
    assert list(names) == list(HF)
    assert names["model.layers.0.self_attn.o_proj.weight"] == ("embed", "heads")
    assert names["model.layers.0.input_layernorm.weight"] == ("embed",)
    assert names["lm_head.weight"] == ("vocab", "embed")
    rules = Rules(vocab="tp", heads="tp", mlp="tp", embed="fsdp")
    specs = logical_to_specs(names, rules, Mesh(fsdp=2, tp=2))
    assert specs["model.layers.0.mlp.up_proj.weight"] == P("tp", "fsdp")


def test_annotate_nested_tree_paths_and_padding():
    params = {"blocks": [{"attn": {"wq": torch.zeros(4, 2, 3)}, "ln": torch.zeros(4)}], "step": torch.tensor(0)}
    assert [path_str(p) for p, _ in tree.leaves_with_path(params)] == ["blocks/0/attn/wq", "blocks/0/ln", "step"]
    names = annotate(params, {r"^blocks/\d+/attn/wq$": ("embed",), r"/ln$": ("embed",), r"^step$": ()})
    assert names == {"blocks": [{"attn": {"wq": ("embed", None, None)}, "ln": ("embed",)}], "step": ()}


def test_annotate_errors():
    with pytest.raises(ShardingError) as e:
        annotate(HF, {k: v for k, v in HF_PATTERNS.items() if k != r"^lm_head"})
    assert "'lm_head.weight'" in str(e.value) and "norm" in str(e.value) and "Fix:" in str(e.value)
    with pytest.raises(ShardingError) as e:
        annotate(HF, {**HF_PATTERNS, r"proj": ("mlp", "embed")})
    msg = str(e.value)
    assert "q_proj.weight" in msg and "'proj'" in msg and "q_proj" in msg and "Fix:" in msg
    # Two patterns that agree on the names are fine.
    assert annotate({"a.b": torch.zeros(2)}, {"a": ("x",), "b": ("x",)}) == {"a.b": ("x",)}
    with pytest.raises(ShardingError, match=r"'model\.layers\.0\.input_layernorm\.weight', shape \(8,\).*3 names"):
        annotate(HF, {**HF_PATTERNS, r"norm\.weight$": ("embed", None, None)})
    with pytest.raises(ShardingError, match="not a valid regular expression"):
        annotate(HF, {"(": ("x",)})
