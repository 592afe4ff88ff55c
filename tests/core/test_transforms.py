"""core.transforms: grad/value_and_grad vs torch.autograd, higher order, remat, vmap, jit, purity."""

import contextvars
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import core
from core import tree
from shardings.testing import assert_close


def _mlp(widths, seed):
    """A random MLP: one {"w": (d_in, d_out), "b": (d_out,)} dict per layer."""
    g = torch.Generator().manual_seed(seed)
    return [
        {"w": torch.randn(a, b, generator=g) / a**0.5, "b": torch.randn(b, generator=g) * 0.1}
        for a, b in itertools.pairwise(widths)
    ]


def _forward(params, x):
    for i, p in enumerate(params):
        x = x @ p["w"] + p["b"]  # (batch, d_out)
        x = torch.tanh(x) if i < len(params) - 1 else x
    return x


def _loss(params, x):
    return (_forward(params, x) ** 2).mean()


def _reference(fn, *args, argnums=(0,)):
    """``fn``'s value and grads w.r.t. ``args[i]`` for i in argnums, with plain torch.autograd."""
    args = [tree.map(lambda t, d=i in argnums: t.detach().clone().requires_grad_(d), a) for i, a in enumerate(args)]
    value = fn(*args)
    watched = [t for i in argnums for t in tree.leaves(args[i])]
    grads = iter(torch.autograd.grad(value, watched))
    return value.detach(), [tree.map(lambda _: next(grads), args[i]) for i in argnums]


def _equal(a, b):
    la, lb = tree.leaves(a), tree.leaves(b)
    return tree.structure(a) == tree.structure(b) and all(torch.equal(x, y) for x, y in zip(la, lb, strict=True))


def _snapshot(t):
    return tree.map(lambda x: x.clone(), t)


def _mlp_and_input(widths, batch, seed):
    return _mlp(widths, seed), torch.randn(batch, widths[0], generator=torch.Generator().manual_seed(seed + 1))


mlps = st.builds(
    _mlp_and_input,
    st.lists(st.integers(1, 6), min_size=2, max_size=5),
    st.integers(1, 4),
    st.integers(0, 2**16),
)


@given(mlps)
def test_value_and_grad_equals_autograd(case):
    params, x = case
    before = _snapshot((params, x))
    value, grads = core.value_and_grad(_loss)(params, x)
    ref_value, (ref_grads,) = _reference(_loss, params, x)
    assert torch.equal(value, ref_value)
    assert _equal(grads, ref_grads)
    assert not value.requires_grad and not any(g.requires_grad for g in tree.leaves(grads))
    # Pure: inputs keep their values, stay non-differentiable and get no .grad.
    assert _equal((params, x), before)
    assert all(not t.requires_grad and t.grad is None for t in tree.leaves((params, x)))


@given(mlps)
@settings(max_examples=10)
def test_argnums_tuple_and_int(case):
    params, x = case
    value, (g_params, g_x) = core.value_and_grad(_loss, argnums=(0, 1))(params, x)
    ref_value, (ref_params, ref_x) = _reference(_loss, params, x, argnums=(0, 1))
    assert torch.equal(value, ref_value)
    assert _equal(g_params, ref_params) and torch.equal(g_x, ref_x)
    assert torch.equal(core.grad(_loss, argnums=1)(params, x), ref_x)  # an int argnums gives the grad, not a tuple


@given(mlps)
@settings(max_examples=10)
def test_has_aux(case):
    params, x = case

    def loss_and_aux(p, x):
        out = _forward(p, x)
        return (out**2).mean(), {"out": out, "note": "kept as is"}

    (value, aux), grads = core.value_and_grad(loss_and_aux, has_aux=True)(params, x)
    _, (ref_grads,) = _reference(_loss, params, x)
    assert torch.equal(value, _loss(params, x))
    assert torch.equal(aux["out"], _forward(params, x)) and aux["note"] == "kept as is"
    assert _equal(grads, ref_grads)
    g, aux2 = core.grad(loss_and_aux, has_aux=True)(params, x)
    assert _equal(g, ref_grads) and torch.equal(aux2["out"], aux["out"])


def test_grad_of_grad():
    x = torch.tensor([1.0, -2.0, 3.0])
    d1 = core.grad(lambda x: (x**3).sum())
    d2 = core.grad(lambda x: d1(x).sum())
    d3 = core.grad(lambda x: d2(x).sum())
    assert torch.equal(d1(x), 3 * x**2)
    assert torch.equal(d2(x), 6 * x)
    assert torch.equal(d3(x), torch.full_like(x, 6.0))


@given(mlps)
@settings(max_examples=10)
def test_hessian_vector_product_equals_autograd(case):
    params, x = case
    v = tree.map(lambda t: torch.ones_like(t) * 0.5, params)

    def grad_dot_v(p):
        g = core.grad(_loss)(p, x)
        return sum((a * b).sum() for a, b in zip(tree.leaves(g), tree.leaves(v), strict=True))

    hvp = core.grad(grad_dot_v)(params)
    flat, spec = tree.flatten(params)
    _, ref = torch.autograd.functional.hvp(
        lambda *leaves: _loss(tree.unflatten(spec, list(leaves)), x), tuple(flat), tuple(tree.leaves(v))
    )
    assert_close(tree.leaves(hvp), list(ref))


def test_unused_leaf_gets_zeros():
    params = {"used": torch.randn(3), "unused": torch.randn(2, 5, dtype=torch.float64)}
    g = core.grad(lambda p: (p["used"] ** 2).sum())(params)
    assert torch.equal(g["used"], 2 * params["used"])
    assert torch.equal(g["unused"], torch.zeros(2, 5, dtype=torch.float64))


@pytest.mark.parametrize(
    ("fn", "has_aux"),
    [
        (lambda x: x * 2, False),  # a vector
        (lambda x: x.detach().sum().item(), False),  # not a tensor
        (lambda x: (x * 2, None), True),  # a vector as the value of (value, aux)
    ],
)
def test_non_scalar_value_raises(fn, has_aux):
    with pytest.raises(TypeError, match="must return a scalar tensor"):
        core.value_and_grad(fn, has_aux=has_aux)(torch.ones(3))


def test_argnums_out_of_range_raises():
    with pytest.raises(TypeError, match=r"argnums=\(0, 2\) but only 2 positional args"):
        core.grad(lambda a, b: (a * b).sum(), argnums=(0, 2))(torch.ones(2), torch.ones(2))


def test_grad_leaves_differentiable_inputs_alone():
    w = torch.randn(4, requires_grad=True)  # e.g. a user's leaf tensor
    g = core.grad(lambda w: (w**2).sum())(w)
    assert torch.equal(g, 2 * w.detach())
    assert w.grad is None


def _deep_mlp_step(remat):
    params = _mlp([32] * 9, seed=0)  # 8 layers
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))

    def layer(p, x):
        h = torch.tanh(x @ p["w"] + p["b"])
        return torch.tanh(h * 2.0 + 1.0) * h  # a few intermediates worth saving

    block = core.remat(layer) if remat else layer

    def loss(params, x):
        for p in params:
            x = block(p, x)
        return (x**2).mean()

    saved_bytes = []

    def pack(t):
        saved_bytes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        value, grads = core.value_and_grad(loss)(params, x)
    return value, grads, sum(saved_bytes)


def test_remat_same_values_fewer_saved_activations():
    value, grads, saved = _deep_mlp_step(remat=False)
    r_value, r_grads, r_saved = _deep_mlp_step(remat=True)
    assert torch.equal(value, r_value)
    assert _equal(grads, r_grads)
    # Without remat each layer saves x, w, the pre-activations and the tanh outputs; with remat the
    # checkpoint keeps only its inputs (its own hook packs them, so the outer hook sees even less).
    assert r_saved < saved / 4, (r_saved, saved)


def test_remat_decorator_with_policy():
    seen = []

    def policy():
        seen.append(True)
        return torch.utils.checkpoint.create_selective_checkpoint_contexts(
            lambda ctx, op, *a, **k: torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
        )

    @core.remat(policy=policy)
    def f(w, x):
        return torch.sin(x @ w).sum()

    w, x = torch.randn(3, 3), torch.randn(2, 3)
    value, g = core.value_and_grad(f)(w, x)
    ref_value, (ref_g,) = _reference(lambda w, x: torch.sin(x @ w).sum(), w, x)
    assert torch.equal(value, ref_value) and torch.equal(g, ref_g)
    assert seen  # the policy was used


@given(mlps)
@settings(max_examples=10)
def test_vmap_over_a_pytree_equals_a_loop(case):
    params, x = case

    def f(params, row):  # row: (d_in,) -> a pytree of outputs
        out = _forward(params, row[None])[0]
        return {"out": out, "norm": (out**2).sum(), "pair": (row.sum(), out.max())}

    batched = core.vmap(f, in_axes=(None, 0))(params, x)
    rows = [f(params, row) for row in x]
    looped = tree.map(lambda *leaves: torch.stack(leaves), *rows)
    assert tree.structure(batched) == tree.structure(looped)
    # Batched matmuls may sum in a different order than one-row ones: fp32 tolerance (docs/equivalence.md's rule).
    assert_close(batched, looped)


def test_vmap_in_axes_per_leaf():
    xs = {"a": torch.randn(5, 3), "b": torch.randn(3, 5)}  # batch on dim 0 of a, dim 1 of b
    out = core.vmap(lambda t: t["a"] * t["b"], in_axes=({"a": 0, "b": 1},))(xs)
    assert torch.equal(out, xs["a"] * xs["b"].T)


def test_jit_matches_eager_and_compiles_once_per_shape():
    # backend: a recording pass-through (like backend="eager"). Inductor compiles C++ on CPU, which
    # took ~65 s here on 2 shared cores; dynamo's capture is what core.jit adds and what we check.
    torch._dynamo.reset()
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @core.jit(backend=record)
    def f(p, x):
        return {"y": torch.tanh(x @ p["w"] + p["b"]).sum(-1), "n": (p["w"] ** 2).sum()}

    p = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    x = torch.randn(2, 3)
    out = f(p, x)
    assert torch.equal(out["y"], torch.tanh(x @ p["w"] + p["b"]).sum(-1))
    assert torch.equal(out["n"], (p["w"] ** 2).sum())
    assert len(graphs) == 1
    f(p, torch.randn(2, 3))
    assert len(graphs) == 1  # same shapes: no recompile
    f(p, torch.randn(5, 3))
    assert len(graphs) == 2  # dynamic=False by default: a new shape gets its own static graph
    torch._dynamo.reset()


def test_value_and_grad_on_dtensor_pytree():
    from shardings import Mesh, P, gather, per_rank, shard, simulate

    params, x = _mlp([4, 6, 2], seed=3), torch.randn(8, 4, generator=torch.Generator().manual_seed(4))
    ref_value, (ref_grads,) = _reference(_loss, params, x)
    with simulate(2):
        mesh = Mesh(tp=2)
        sharded = shard(params, [{"w": P(None, "tp"), "b": P("tp")}, {"w": P("tp"), "b": None}], mesh)
        value, grads = core.value_and_grad(_loss)(sharded, shard(x, None, mesh))
        full = gather(grads)
        values = per_rank(value.full_tensor())
    for v in values:
        assert_close(v, ref_value)
    for g, r in zip(tree.leaves(full), tree.leaves(ref_grads), strict=True):
        for v in per_rank(g):
            assert_close(v, r)


_AMBIENT = contextvars.ContextVar("ambient", default=1.0)


def test_remat_recomputes_under_the_context_forward_saw():
    # backward runs outside the `set` below (as a pipeline rank's backward runs outside the stage's call): the
    # recompute must still read 3.0, or its saved values would not match forward's
    def scaled(x):
        return torch.sin(x * _AMBIENT.get())

    x = torch.linspace(-1, 1, 5, requires_grad=True)
    token = _AMBIENT.set(3.0)
    y = core.remat(scaled)(x).sum()
    _AMBIENT.reset(token)
    (g,) = torch.autograd.grad(y, x)
    torch.testing.assert_close(g, 3.0 * torch.cos(3.0 * x.detach()))
