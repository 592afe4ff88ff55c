"""shardings.ops.module_tp: nn.TransformerEncoderLayer under tensor parallelism works, or is refused before any work."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import core
import shardings
from shardings import Mesh, ShardingError, per_rank
from shardings.ops import module_tp
from shardings.testing import EquivalenceError, assert_close, check_equivalence

EMBED, HEADS, FF = 16, 4, 32
RULES = {  # logical names of a TransformerEncoderLayer's weights, before and after local_heads
    r"in_proj_weight$": (None, "embed"), r"in_proj_bias$": (None,),  # fused [q | k | v]: kept whole
    r"[qkv]_proj\.weight$": ("heads", "embed"), r"[qkv]_proj\.bias$": ("heads",),  # local_heads': split
    r"out_proj\.weight$": ("embed", "heads"), r"out_proj\.bias$": ("embed",),
    r"linear1\.weight$": ("mlp", "embed"), r"linear1\.bias$": ("mlp",),
    r"linear2\.weight$": ("embed", "mlp"), r"linear2\.bias$": ("embed",),
    r"norm\d\.(weight|bias)$": ("embed",),
}


def _encoder_layer(heads=HEADS, bias=True):
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(EMBED, heads, FF, dropout=0.0, batch_first=True, bias=bias)


def _model(module, rules=RULES):
    """``(init, loss, names)`` of ``module`` through module_tp.functional_call, its own weights as init."""
    weights = {k: v.detach().clone() for k, v in module.named_parameters()}
    names = shardings.annotate(weights, rules)

    def init(key, cfg):
        return dict(weights)

    def loss(params, batch, cfg=None):
        x = shardings.constrain(batch["x"], ("batch", "seq", "embed"))
        y = module_tp.functional_call(module, params, (x,))
        return ((y - shardings.constrain(batch["y"], ("batch", "seq", "embed"))) ** 2).mean()

    return init, loss, names


def _batch():
    gen = torch.Generator().manual_seed(1)
    return {"x": torch.randn(8, 6, EMBED, generator=gen), "y": torch.randn(8, 6, EMBED, generator=gen)}


# ---- LocalHeadsAttention is nn.MultiheadAttention -------------------------------------------------


@st.composite
def attention_calls(draw):
    """An nn.MultiheadAttention and the arguments of one call of it."""
    batch_first, batched = draw(st.booleans()), draw(st.booleans())
    kdim = draw(st.sampled_from([None, 12]))  # 12: separate q/k/v weights in nn.MultiheadAttention
    torch.manual_seed(draw(st.integers(0, 3)))
    mha = nn.MultiheadAttention(EMBED, HEADS, bias=draw(st.booleans()), kdim=kdim, vdim=kdim,
                                batch_first=batch_first)
    n, seq, kv_seq = 3, 5, 7
    shape = lambda s, e: ((n, s, e) if batch_first else (s, n, e)) if batched else (s, e)
    query, key = torch.randn(shape(seq, EMBED)), torch.randn(shape(kv_seq, kdim or EMBED))
    kwargs = {"need_weights": draw(st.booleans()), "average_attn_weights": draw(st.booleans())}
    mask = draw(st.sampled_from(["none", "padding", "float", "bool_per_head", "causal"]))
    if mask == "padding":
        kwargs["key_padding_mask"] = torch.arange(kv_seq) >= (4 if not batched else torch.tensor([[4], [7], [5]]))
    elif mask == "float":
        kwargs["attn_mask"] = torch.randn(seq, kv_seq)
    elif mask == "bool_per_head" and batched:
        kwargs["attn_mask"] = torch.rand(n * HEADS, seq, kv_seq) > 0.7
        kwargs["attn_mask"][..., 0] = False  # every row sees something
    elif mask == "causal":
        key = torch.randn(shape(seq, kdim or EMBED))
        kwargs.update(attn_mask=nn.Transformer.generate_square_subsequent_mask(seq), is_causal=True)
    return mha, (query, key, key.clone()), kwargs


@given(attention_calls())
@settings(max_examples=20)
def test_local_heads_attention_computes_what_multihead_attention_computes(call):
    mha, args, kwargs = call
    want_out, want_weights = mha(*args, **kwargs)
    got_out, got_weights = module_tp.local_heads(mha)(*args, **kwargs)
    assert_close(got_out, want_out, terms=EMBED)
    if kwargs["need_weights"]:
        assert_close(got_weights, want_weights, terms=EMBED)
    else:
        assert got_weights is None and want_weights is None


@pytest.mark.parametrize("module", [
    _encoder_layer(),
    nn.TransformerDecoderLayer(EMBED, HEADS, FF),  # self- and cross-attention
    nn.MultiheadAttention(EMBED, HEADS, kdim=12, vdim=8),  # separate q/k/v weights
])
def test_fused_state_dict_gives_back_the_original_names_and_values(module):
    converted = module_tp.local_heads(module)
    assert not any(isinstance(m, nn.MultiheadAttention) for m in converted.modules())
    assert any(isinstance(m, nn.MultiheadAttention) for m in module.modules())  # the original is kept
    back = module_tp.fused_state_dict(converted)
    assert sorted(back) == sorted(module.state_dict())
    assert_close(back, dict(module.state_dict()))


def test_local_heads_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="add_bias_kv or add_zero_attn"):
        module_tp.local_heads(nn.MultiheadAttention(EMBED, HEADS, add_bias_kv=True))


# ---- what works under tensor parallelism -----------------------------------------------------------


@pytest.mark.parametrize(("recipe", "layouts"), [
    ("fused in-projection whole", ["tp", "zero3+tp", "tp+sp"]),
    ("local heads", ["dp+tp", "zero3+tp", "tp+sp"]),
])
def test_transformer_encoder_layer_matches_one_device(recipe, layouts):
    # local heads without biases: the key's bias has a gradient of exactly zero (softmax ignores a
    # shift of every score in a row), which compares as rounding noise against rounding noise
    module = _encoder_layer() if recipe.startswith("fused") else module_tp.local_heads(_encoder_layer(bias=False))
    init, loss, names = _model(module)
    report = check_equivalence(init, loss, names, None, _batch(), layouts=layouts, mesh=Mesh(dp=2, tp=2), steps=2)
    assert report.ok


@pytest.mark.parametrize("recipe", ["fused in-projection whole", "local heads"])
def test_with_accumulation_and_clipping_too(recipe):
    module = _encoder_layer() if recipe.startswith("fused") else module_tp.local_heads(_encoder_layer(bias=False))
    init, loss, names = _model(module)
    report = check_equivalence(init, loss, names, None, _batch(), layouts=["dp+tp", "zero3+tp"], mesh=Mesh(dp=2, tp=2),
                               steps=2, accum_steps=2, clip_norm=0.05)
    assert report.ok


def test_a_one_percent_error_in_sharded_attention_is_caught(monkeypatch):
    """Planted: attention on DTensors (the tensor-parallel path only) returns 1.01 × the right output."""
    from torch.distributed.tensor import DTensor

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def off_by_one_percent(q, *args, **kwargs):
        out = sdpa(q, *args, **kwargs)
        return out * 1.01 if isinstance(q, DTensor) else out

    monkeypatch.setattr(module_tp.F, "scaled_dot_product_attention", off_by_one_percent)
    init, loss, names = _model(module_tp.local_heads(_encoder_layer(bias=False)))
    with pytest.raises(EquivalenceError):
        check_equivalence(init, loss, names, None, _batch(), layouts=["dp+tp"], mesh=Mesh(dp=2, tp=2), steps=2)


def test_local_heads_attend_on_each_ranks_own_heads_without_gathering_them():
    init, loss, names = _model(module_tp.local_heads(_encoder_layer(bias=False)))
    batch = _batch()
    with shardings.simulate(4):
        mesh = Mesh(dp=2, tp=2)
        params = shardings.init(init, core.random.key(0), None, axes=names, layout="dp+tp", mesh=mesh)
        step = shardings.train_step(loss, core.optim.sgd(0.1), layout="dp+tp", mesh=mesh)
        state = step.init(params)
        with shardings.comms() as comms:
            step(params, state, batch)
    # over tp only all-reduces (out_proj's and linear2's outputs, the input's gradient: Megatron's, and
    # the step's scalar metrics): q, k and v are never gathered (the fused recipe all-gathers over tp)
    assert {row["kind"] for row in comms.rows() if row["axis"] == "tp"} == {"all_reduce"}


# ---- what is refused, and when ---------------------------------------------------------------------


def _first_step_fails(module, rules, mesh_shape, layout):
    """Run one train step; return its error, after checking that no parameter changed and no update ran."""
    init, loss, names = _model(module, rules)
    updates = []
    sgd = core.optim.sgd(0.1)
    spied = sgd._replace(update=lambda *a, **k: updates.append(1) or sgd.update(*a, **k), fused_step=None)
    batch = _batch()
    with shardings.simulate(4):
        mesh = Mesh(**mesh_shape)
        params = shardings.init(init, core.random.key(0), None, axes=names, layout=layout, mesh=mesh)
        before = {k: per_rank(v.full_tensor()) for k, v in params.items()}
        step = shardings.train_step(loss, spied, layout=layout, mesh=mesh)
        state = step.init(params)
        with pytest.raises(ShardingError) as failure:
            step(params, state, batch)
        after = {k: per_rank(v.full_tensor()) for k, v in params.items()}
    assert not updates
    assert_close(after, before, ulps=0)
    return str(failure.value)


def test_a_split_fused_in_projection_is_refused_before_it_runs_naming_the_parameter_and_the_fixes():
    split_fused = {**RULES, r"in_proj_weight$": ("heads", "embed"), r"in_proj_bias$": ("heads",)}
    message = _first_step_fails(_encoder_layer(), split_fused, {"dp": 2, "tp": 2}, "zero3+tp")
    assert message.startswith("at self_attn.in_proj_weight, spec P('tp'), mesh Mesh(dp=2, tp=2): ")
    for words in ("unflatten(-1, (3, embed_dim))", "aten.view", "not whole heads", "first dim None",
                  "keep the module out of tp", "shardings.ops.module_tp.local_heads(module)"):
        assert words in message


def test_heads_that_do_not_divide_over_tp_are_refused_naming_the_projection():
    message = _first_step_fails(module_tp.local_heads(_encoder_layer(heads=2, bias=False)), RULES, {"tp": 4}, "tp")
    assert message.startswith("at self_attn.q_proj.weight, spec P('tp'), mesh Mesh(tp=4): 2 heads do not split")
    assert "divides num_heads (2)" in message


def test_an_uneven_sequence_under_sp_is_refused_at_the_first_step_naming_the_op_and_the_submodule():
    # seq 6 over tp=4 splits into 2, 2, 1, 1 rows; nn.Linear flattens (seq, batch) before its matmul
    message = _first_step_fails(_encoder_layer(), RULES, {"tp": 4}, "tp+sp")
    assert message.startswith("at module 'self_attn', mesh Mesh(tp=4): DTensor cannot run aten._unsafe_view.default")
    assert "Cannot flatten unevenly sharded tensor" in message and "divisible by the mesh axis" in message


def test_dtensor_errors_names_the_op_the_mesh_and_the_fix():
    # torch.func.functional_call (no pre-check): DTensor's own failure, translated
    module, x = _encoder_layer(), torch.randn(2, 6, EMBED)
    with shardings.simulate(4):
        mesh = Mesh(dp=2, tp=2)
        params = {k: distribute_tensor(v.detach(), mesh.device_mesh, (Replicate(), Shard(0)))
                  for k, v in module.named_parameters() if k.startswith("self_attn.in_proj")}
        x = distribute_tensor(x, mesh.device_mesh, (Replicate(), Replicate()))
        with shardings.use(mesh, "tp"), pytest.raises(ShardingError) as failure, module_tp.dtensor_errors():
            torch.func.functional_call(module, params, (x,))
    message = str(failure.value)
    assert message.startswith("mesh Mesh(dp=2, tp=2): DTensor cannot run aten.view.default on the layout's placements")
    assert "Cannot unflatten unevenly sharded tensor" in message and "local_heads" in message
    assert isinstance(failure.value.__cause__, RuntimeError)


def test_a_failure_inside_functional_call_names_the_submodule_running():
    class AddBuffer(nn.Module):  # a buffer the caller did not pass: a plain tensor meets a DTensor
        def __init__(self):
            super().__init__()
            self.register_buffer("shift", torch.ones(4))

        def forward(self, x):
            return x + self.shift

    module, x = nn.Sequential(nn.Linear(4, 4), AddBuffer()), torch.randn(2, 4)
    with shardings.simulate(4):
        mesh = Mesh(dp=2, tp=2)
        params = {k: distribute_tensor(v.detach(), mesh.device_mesh, (Replicate(), Replicate()))
                  for k, v in module.named_parameters()}
        with shardings.use(mesh, "tp"), pytest.raises(ShardingError) as failure:
            module_tp.functional_call(module, params, (shardings.constrain(x, (None, None)),))
    message = str(failure.value)
    assert message.startswith("at module '1', mesh Mesh(dp=2, tp=2): DTensor cannot run aten.add.Tensor")
    assert "shardings.constrain" in message


def test_errors_that_are_not_dtensors_pass_unchanged():
    with pytest.raises(RuntimeError, match=r"^something else$"), module_tp.dtensor_errors():
        raise RuntimeError("something else")
