"""``shard_map`` against full-tensor references, in the style of JAX's ``tests/shard_map_test.py``.

Random functions × random meshes (1–8 ranks, up to 3 axes) × random in/out specs: each rank's
output block must equal its slice of the reference computed on full tensors, and gradients
through ``shard_map`` must equal the reference's.
"""

from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, Replicate

import core
from shardings import Mesh, P, ShardingError, per_rank, simulate
from shardings.comm.collectives import all_gather, all_to_all, axis_index, pmean, ppermute, psum, psum_scatter
from shardings.comm.shard_map import shard_map
from shardings.runtime.compat import rank_map
from shardings.runtime.launch import launch
from shardings.spec.lower import local_block, rank_coords, to_placements
from shardings.testing import assert_close
from shardings.testing.strategies import meshes, specs


class Case(NamedTuple):
    f: object  # the per-rank function
    reference: object  # the same computation on full tensors
    in_specs: tuple
    out_specs: P
    shapes: tuple


def _entry(axes):
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


@st.composite
def axis_groups(draw, mesh, k):
    """``k`` disjoint tuples of mesh axes (some maybe empty), each in a random order."""
    groups = [[] for _ in range(k + 1)]  # the last group is left unused: replicated everywhere
    for name in draw(st.permutations(mesh.axis_names)):
        groups[draw(st.integers(0, k))].append(name)
    return [tuple(g) for g in groups[:k]]


def _dim(draw, mesh, axes):
    return mesh.axis_size(axes) * draw(st.integers(1, 2))


KINDS = ("identity", "transpose", "elementwise", "matmul", "sum", "mean", "gather")


@st.composite
def cases(draw, mesh):
    kind = draw(st.sampled_from(KINDS))
    if kind == "matmul":
        gi, gc, gj = draw(axis_groups(mesh, 3))
        m, k, n = (_dim(draw, mesh, g) for g in (gi, gc, gj))
        shapes = ((m, k), (k, n))
        return Case(
            lambda x, w: psum(x @ w, gc),
            lambda x, w: x @ w,
            (P(_entry(gi), _entry(gc)), P(_entry(gc), _entry(gj))),
            P(_entry(gi), _entry(gj)),
            shapes,
        )
    g0, g1 = draw(axis_groups(mesh, 2))
    shape = (_dim(draw, mesh, g0), _dim(draw, mesh, g1))
    spec = P(_entry(g0), _entry(g1))
    local_and_global = {
        "identity": (lambda x: x, lambda x: x, spec),
        "transpose": (lambda x: x.T, lambda x: x.T, P(_entry(g1), _entry(g0))),
        "sum": (lambda x: psum(x.sum(0), g0), lambda x: x.sum(0), P(_entry(g1))),
        "mean": (lambda x: pmean(x.mean(0), g0), lambda x: x.mean(0), P(_entry(g1))),
        "gather": (lambda x: all_gather(x, g0, tiled=True).cumsum(0), lambda x: x.cumsum(0), P(None, _entry(g1))),
    }
    if kind == "elementwise":
        fn = lambda x, y: x * y + torch.sin(x)
        return Case(fn, fn, (spec, spec), spec, (shape, shape))
    f, reference, out_spec = local_and_global[kind]
    return Case(f, reference, (spec,), out_spec, (shape,))


def _assert_close(got, want, what):
    """Every rank's value of ``got`` equals the plain tensor ``want``."""
    for r, v in enumerate(per_rank(got)):
        assert_close(v, want, msg=f"{what}, rank {r}")


def _everywhere(full):
    """The same tensor on every simulated rank (a tensor made outside ``simulate`` has no per-rank copies)."""
    return rank_map(lambda _: full.clone())


def _as_input(full, spec, mesh):
    """A leaf input: the full tensor itself, or a DTensor laid out by ``spec`` (another layout than in_specs)."""
    x = _everywhere(full)
    if spec is not None:
        dm = mesh.device_mesh
        x = DTensor.from_local(x, dm, [Replicate()] * dm.ndim).redistribute(dm, to_placements(spec, mesh, full.shape))
    return x.detach().requires_grad_(True)


def _full(x):
    return x.full_tensor() if isinstance(x, DTensor) else x


@settings(max_examples=30)
@given(st.data())
def test_shard_map_matches_full_tensor_reference(data):
    mesh = data.draw(meshes(max_ranks=8), "mesh")
    case = data.draw(cases(mesh), "case")
    layouts = [data.draw(st.none() | specs(shape, mesh), f"input layout {i}") for i, shape in enumerate(case.shapes)]
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(shape, generator=gen, requires_grad=True) for shape in case.shapes]
    ref = case.reference(*fulls)
    cot = torch.randn(ref.shape, generator=gen)
    ref_grads = torch.autograd.grad((ref * cot).sum(), fulls)
    ref = ref.detach()
    with simulate(mesh.size):
        xs = [_as_input(x.detach(), layout, mesh) for x, layout in zip(fulls, layouts)]
        out = shard_map(case.f, mesh, case.in_specs, case.out_specs)(*xs)
        assert isinstance(out, DTensor) and out.shape == ref.shape
        # Per-block reference: each rank's block is its slice of the full result.
        for r, (coords, block) in enumerate(zip(rank_coords(mesh), per_rank(out.to_local()))):
            want = ref[local_block(ref.shape, case.out_specs, mesh, coords)]
            assert_close(block, want, msg=f"block of rank {r}")
        grads = torch.autograd.grad((out.full_tensor() * _everywhere(cot)).sum(), xs)
        for i, (g, want) in enumerate(zip(grads, ref_grads)):
            _assert_close(_full(g), want, f"grad of input {i}")


def test_value_and_grad_through_shard_map_with_replicated_inputs():
    """A replicated input's gradient adds up every rank's contribution (a DTensor ``Partial``)."""
    mesh = Mesh(dp=2, tp=2)
    layer = shard_map(lambda x, w: psum(x @ w, "tp"), mesh, (P("dp", "tp"), P("tp")), P("dp"))

    def loss(params, x):
        return (layer(x, params["w"]).full_tensor() ** 2).mean() + (params["w"] ** 2).sum()

    x = torch.arange(24.0).reshape(4, 6) / 10
    w = torch.linspace(-1, 1, 18).reshape(6, 3)
    ref_value, ref_grads = core.value_and_grad(lambda p, x: ((x @ p["w"]) ** 2).mean() + (p["w"] ** 2).sum())(
        {"w": w}, x
    )
    with simulate(mesh.size):
        value, grads = core.value_and_grad(loss)({"w": _everywhere(w)}, _everywhere(x))
        _assert_close(value, ref_value, "loss")
        _assert_close(grads["w"], ref_grads["w"], "grad")


def test_replicated_in_and_out_scale_gradients_by_the_replica_count():
    """``psum`` of a replicated value is ``n * x``; its gradient must be ``n``, not ``1`` or ``n**2``."""
    mesh = Mesh(a=2, b=3)
    with simulate(mesh.size):
        x = torch.ones(3, requires_grad=True)
        y = shard_map(lambda t: psum(t, "b") * 2, mesh, P(), P())(x)
        (g,) = torch.autograd.grad(y.full_tensor().sum(), x)
        _assert_close(y.full_tensor(), torch.full((3,), 6.0), "value")
        _assert_close(g, torch.full((3,), 6.0), "grad")


def test_pytree_arguments_and_outputs_with_spec_prefixes():
    mesh = Mesh(dp=2, tp=2)

    def f(batch, params, scale):
        h = batch["x"] @ params["w"]
        return {"y": psum(h, "tp") * scale, "h": h}

    with simulate(mesh.size):
        batch = {"x": torch.arange(16.0).reshape(4, 4)}
        params = {"w": torch.eye(4)}
        out = shard_map(f, mesh, (P("dp", "tp"), {"w": P("tp")}, None), {"y": P("dp"), "h": P("dp", None)})(
            batch, params, 3.0
        )
        _assert_close(out["y"].full_tensor(), 3 * batch["x"], "y")
        assert out["h"].placements == tuple(to_placements(P("dp"), mesh))


@pytest.mark.parametrize(
    ("in_specs", "args", "message"),
    [
        ((P("dp"),), (1, 2), r"in_specs has no spec for args\[1\]; in_specs must be a tree prefix of args"),
        ((P("dp"), P(), P()), (1, 2), r"args\[2\] does not exist"),
        (({"w": P()},), ({"b": 1},), r"args\[0\]\['w'\] does not exist"),
        (("dp",), (1,), r"in_specs has a str leaf 'dp' where a P\(...\) \(or None\) was expected"),
    ],
)
def test_in_specs_that_do_not_match_the_args_name_the_key_path(in_specs, args, message):
    mesh = Mesh(dp=2)
    with pytest.raises((ShardingError, TypeError), match=message) as info:
        shard_map(lambda *a: a, mesh, in_specs, P())(*args)
    assert "mesh Mesh(dp=2)" in str(info.value) and "Fix: " in str(info.value)


def test_spec_errors_name_the_path_spec_and_mesh():
    mesh = Mesh(dp=2, tp=2)
    with simulate(mesh.size):
        x = {"w": torch.ones(3, 4)}
        with pytest.raises(ShardingError, match=r"at args\[0\]\['w'\], spec P\('dp'\), shape \(3, 4\), mesh .*dim 0"):
            shard_map(lambda p: p, mesh, P("dp"), P())(x)
        with pytest.raises(ShardingError, match=r"args\[0\]\['w'\].*unknown mesh axis 'sp'"):
            shard_map(lambda p: p, mesh, P(None, "sp"), P())(x)
        with pytest.raises(ShardingError, match=r"outputs\['w'\].*unknown mesh axis 'ep'"):
            shard_map(lambda p: p, mesh, P(), P("ep"))(x)


def _every_collective(x, w):
    """One program through every collective and its backward; runs unchanged on simulated or real ranks."""
    mesh = Mesh(a=2, b=2)
    x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)

    def f(x, w):
        h = all_gather(psum(x @ w, "b"), "a", tiled=True)  # [4, 4]
        h = ppermute(h, ("b", "a"), [(0, 3), (3, 1), (1, 0)]) + axis_index(("b", "a"))
        h = all_to_all(h, "b", 1, 0, tiled=True)  # [8, 2]
        return pmean(psum_scatter(h, "a", tiled=True), "b")  # [4, 2]

    out = shard_map(f, mesh, (P("a", "b"), P("b")), P(None, "a"))(x, w).full_tensor()
    grads = torch.autograd.grad((out * torch.arange(out.numel()).reshape(out.shape)).sum(), (x, w))
    return [out.detach(), *grads]


@pytest.mark.multiprocess
def test_real_processes_agree_with_simulated_ranks():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 6, generator=gen), torch.randn(6, 4, generator=gen)
    real = launch(_every_collective, 4, x, w)
    with simulate(4):
        simulated = [per_rank(t) for t in _every_collective(_everywhere(x), _everywhere(w))]
    for rank, values in enumerate(real):
        for i, value in enumerate(values):
            assert_close(value, simulated[i][rank])


def test_a_tensor_made_outside_simulate_cannot_take_gradients():
    outside = torch.ones(2, requires_grad=True)
    with simulate(2), pytest.raises(TypeError, match=r"at args\[0\].*created outside `simulate` needs gradients"):
        shard_map(lambda t: t, Mesh(dp=2), P(), P())(outside)


def test_remat_around_shard_map_and_its_clear_error_inside():
    mesh = Mesh(tp=2)
    block = lambda t: torch.sin(psum(t, "tp")) * 2
    full = torch.linspace(-1, 1, 8).reshape(4, 2).requires_grad_(True)
    (want,) = torch.autograd.grad((torch.sin(full.reshape(2, 2, 2).sum(0)) * 2).sum(), full)
    with simulate(mesh.size):
        x = _everywhere(full.detach()).requires_grad_(True)
        (g,) = torch.autograd.grad(core.remat(shard_map(block, mesh, P("tp"), P()))(x).full_tensor().sum(), x)
        _assert_close(g, want, "grad with remat around shard_map")
        y = shard_map(core.remat(block), mesh, P("tp"), P())(x).full_tensor().sum()
        with pytest.raises(RuntimeError, match=r"recomputed during backward.*Fix: apply core.remat to the whole"):
            torch.autograd.grad(y, x)
