"""shard / gather / reshard / spec_of / partial_axes on trees, with prefix spec trees and clear errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Shard

from shardings import Mesh, P, gather, partial_axes, per_rank, reshard, shard, simulate, spec_of, unwrap
from shardings.runtime.compat import LocalTensor
from shardings.spec.lower import local_block, rank_coords
from shardings.testing import meshes, specs

shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)


def arange(shape):
    """Distinct values everywhere, so any misplaced element shows."""
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape)


def same_layout(a: P, b: P, shape, mesh) -> bool:
    return all(local_block(shape, a, mesh, c) == local_block(shape, b, mesh, c) for c in rank_coords(mesh))


@given(mesh=meshes(), shape=shapes, data=st.data())
@settings(max_examples=40)
def test_shard_then_gather_is_identity(mesh, shape, data):
    spec = data.draw(specs(shape, mesh))
    x = arange(shape)
    with simulate(mesh.size):
        d = shard(x, spec, mesh)
        assert isinstance(d, DTensor)
        got = spec_of(d)
        full = unwrap(gather(d))
    assert full.dtype == x.dtype
    assert torch.equal(full, x)
    # spec_of gives the spec back; inside a tuple a size-1 axis's place is not recoverable.
    assert got == spec.normalized() or same_layout(got, spec, shape, mesh)


@given(mesh=meshes(), shape=shapes, data=st.data())
@settings(max_examples=30)
def test_reshard_keeps_values_and_takes_the_new_spec(mesh, shape, data):
    a, b = data.draw(specs(shape, mesh)), data.draw(specs(shape, mesh))
    x = arange(shape)
    with simulate(mesh.size):
        d = reshard(shard(x, a, mesh), b)
        shards = per_rank(d)
        got = spec_of(d)
        full = unwrap(gather(d))
    assert torch.equal(full, x)
    assert got == b.normalized() or same_layout(got, b, shape, mesh)
    for coords, local in zip(rank_coords(mesh), shards):
        assert torch.equal(local, x[local_block(shape, b, mesh, coords)])


def params():
    return {
        "embed": arange((8, 4)),
        "blocks": [{"w": arange((4, 6)), "b": arange((6,))}, {"w": arange((4, 6)), "b": arange((6,))}],
        "head": {"w": arange((4, 8)), "scale": 2.0, "note": None},
    }


def test_prefix_spec_trees_on_nested_params():
    mesh = Mesh(dp=2, tp=2)
    tree = {"embed": P("tp"), "blocks": P("dp"), "head": {"w": P(None, ("tp", "dp")), "scale": None, "note": None}}
    x = params()
    with simulate(4):
        sharded = shard(x, tree, mesh)
        got = spec_of(sharded)
        full = gather(sharded)
        w_shards = per_rank(sharded["blocks"][1]["w"])
    assert got == {
        "embed": P("tp"),
        "blocks": [{"w": P("dp"), "b": P("dp")}, {"w": P("dp"), "b": P("dp")}],
        "head": {"w": P(None, ("tp", "dp")), "scale": None, "note": None},
    }
    assert full["head"]["scale"] == 2.0 and full["head"]["note"] is None
    for path in [("embed",), ("blocks", 0, "b"), ("blocks", 1, "w"), ("head", "w")]:
        want, have = x, full
        for key in path:
            want, have = want[key], have[key]
        assert torch.equal(unwrap(have), want)
    assert [t.shape for t in w_shards] == [(2, 6), (2, 6), (2, 6), (2, 6)]


def test_one_spec_for_the_whole_tree():
    with simulate(2):
        sharded = shard(params(), None, Mesh(dp=2))
        got = spec_of(sharded)
        assert reshard(sharded, None)["head"]["scale"] == 2.0
    assert got["blocks"][0] == {"w": P(), "b": P()} and got["head"]["note"] is None


@pytest.mark.parametrize(
    ("specs_tree", "path", "words"),
    [
        ({"embed": P("tp"), "head": None}, "['blocks'][0]['w']", "no entry for this leaf"),
        ({"embed": P(), "blocks": [None], "head": None}, "['blocks'][1]['w']", "no entry for this leaf"),
        ({"embed": P(), "blocks": None, "head": None, "extra": P("dp")}, "['extra']", "values tree does not"),
        ({"embed": P(), "blocks": None, "head": {"w": {"k": P()}}}, "['head']['w']['k']", "values tree does not"),
        ({"embed": P(), "blocks": P(None, "dp"), "head": None}, "['blocks'][0]['b']", "only 1 dim"),
        ({"embed": P("sp"), "blocks": None, "head": None}, "['embed']", "unknown mesh axis 'sp'"),
        ({"embed": ("tp",), "blocks": None, "head": None}, "['embed'][0]", "expected a P(...) spec"),
        (
            {"embed": P(), "blocks": None, "head": {"w": None, "scale": P("dp"), "note": None}},
            "['head']['scale']",
            "not a tensor",
        ),
    ],
)
def test_errors_name_the_key_path(specs_tree, path, words):
    mesh = Mesh(dp=2, tp=2)
    with simulate(4), pytest.raises((ValueError, TypeError)) as e:
        shard(params(), specs_tree, mesh)
    msg = str(e.value)
    assert f"at {path}" in msg and words in msg and "Mesh(dp=2, tp=2)" in msg and "Fix: " in msg


@st.composite
def invalid_specs(draw, mesh, ndim):
    """A spec that is wrong for a tensor of `ndim` dims on `mesh`, and the words its error must contain."""
    kind = draw(st.sampled_from(["unknown", "too_long"]))
    if kind == "unknown":
        bad = draw(st.text("xyz", min_size=1, max_size=3))
        entries = [None] * ndim
        entries[draw(st.integers(0, ndim - 1))] = bad
        return P(*entries), f"unknown mesh axis {bad!r}"
    n = draw(st.integers(ndim + 1, ndim + 3))
    return P(*[None] * n), f"the spec has {n} entries"


@given(
    mesh=meshes(axis_names=("dp", "tp", "ep")), ndim=st.integers(1, 3), key=st.sampled_from(["w", "b"]), data=st.data()
)
@settings(max_examples=30)
def test_invalid_specs_raise_with_path_spec_and_mesh(mesh, ndim, key, data):
    spec, words = data.draw(invalid_specs(mesh, ndim))
    x = {"w": torch.ones((2,) * ndim), "b": torch.ones((2,) * ndim)}
    tree = {"w": None, "b": None, key: spec}
    with simulate(mesh.size), pytest.raises(ValueError) as e:
        shard(x, tree, mesh)
    msg = str(e.value)
    assert f"at ['{key}']" in msg and repr(spec) in msg and repr(mesh) in msg and words in msg and "Fix: " in msg


def test_shard_rejects_dtensors_and_reshard_rejects_plain_sharded():
    mesh = Mesh(dp=2)
    with simulate(2):
        d = shard(torch.ones(4), P("dp"), mesh)
        with pytest.raises(TypeError, match=r"already is a DTensor with spec P\('dp'\).*reshard"):
            shard({"w": d}, P(), mesh)
        with pytest.raises(TypeError, match=r"at \['w'\].*not a DTensor"):
            reshard({"w": torch.ones(4)}, {"w": P("dp")})
        assert reshard({"w": torch.ones(4)}, None)["w"].shape == (4,)  # plain leaves pass through


def test_shard_without_a_process_group_says_how_to_start_one():
    with pytest.raises(RuntimeError, match=r"simulate\(4\)"):
        shard(torch.ones(4), P("dp"), Mesh(dp=4))


def test_mesh_must_match_world_size():
    with simulate(4), pytest.raises(ValueError, match=r"mesh has 2 ranks but the world size is 4.*Fix: "):
        shard(torch.ones(4), P("dp"), Mesh(dp=2))


def unreduced_grad(mesh):
    """A data-parallel gradient, Partial over dp and sharded over tp: rank r holds a (2, 3) block of r's."""
    local = LocalTensor({r: torch.full((2, 3), float(r)) for r in range(mesh.size)})
    return DTensor.from_local(local, mesh.device_mesh, [Partial(), Shard(0)], run_check=False)


def test_partial_dtensors():
    mesh = Mesh(dp=2, tp=2)
    # Rows 0:2 live on tp=0 (ranks 0, 2): 0 + 2; rows 2:4 on tp=1 (ranks 1, 3): 1 + 3.
    want = torch.tensor([[2.0] * 3] * 2 + [[4.0] * 3] * 2)
    with simulate(4):
        g = unreduced_grad(mesh)
        assert partial_axes({"g": g, "n": 1}) == {"g": {"dp": "sum"}, "n": {}}
        with pytest.raises(ValueError, match=r"at \['g'\].*unreduced \(Partial\) over \{'dp': 'sum'\}.*reshard"):
            spec_of({"g": g})
        full = unwrap(gather(g))
        reduced = reshard(g, P(("tp", "dp")))  # reduce-scatter over dp
        assert spec_of(reduced) == P(("tp", "dp")) and partial_axes(reduced) == {}
        scattered = unwrap(gather(reduced))
        shards = per_rank(reduced)
    assert torch.equal(full, want) and torch.equal(scattered, want)
    assert [s.shape for s in shards] == [(1, 3)] * 4


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (P(("tp", "dp")), P(("dp", "tp"))),
        (P(("dp", "tp")), P(("tp", "dp"))),
        (P(("tp", "dp")), P("dp", "tp")),
        (P("tp"), P(None, ("tp", "dp"))),
        (P(None, ("tp", "dp")), P()),
    ],
)
def test_reshard_from_and_to_out_of_mesh_order_tuples(a, b):
    mesh = Mesh(dp=2, tp=3)
    x = arange((6, 12))
    with simulate(6):
        d = reshard(shard(x, a, mesh), b)
        got, shards, full = spec_of(d), per_rank(d), unwrap(gather(d))
    assert got == b and torch.equal(full, x)
    for coords, local in zip(rank_coords(mesh), shards):
        assert torch.equal(local, x[local_block((6, 12), b, mesh, coords)])
