"""Each collective, forward and backward, against a per-rank reference computed on full tensors.

Rank ``r`` holds row ``r`` of a stacked tensor ``X: [world, ...]`` (``in_specs`` splits dim 0 over
every mesh axis), runs one collective, and its result becomes row ``r`` of ``Y``. The reference
computes each row of ``Y`` from the rows of the rank's group with plain torch ops, so autograd on
the reference gives the exact transpose the collective's backward must match.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from shardings import Mesh, ShardingError, per_rank, simulate
from shardings.comm.collectives import (
    all_gather,
    all_to_all,
    axis_index,
    axis_size,
    bind_mesh,
    pmean,
    ppermute,
    psum,
    psum_scatter,
)
from shardings.runtime.compat import maybe_disable_local_tensor_mode, rank_map
from shardings.spec.lower import rank_coords
from shardings.spec.mesh import axis_of_group
from shardings.testing import assert_close

MESH = Mesh(a=2, b=2, c=2)


@pytest.fixture(scope="module", autouse=True)
def _ranks():
    """One simulated world for the whole module: its device meshes and groups are built once."""
    with simulate(MESH.size):
        yield


def _groups(mesh, names):
    """Per rank: (its index along ``names``, the ranks of its group in axis-index order)."""
    coords = rank_coords(mesh)
    index = [0] * mesh.size
    for r, c in enumerate(coords):
        for n in names:
            index[r] = index[r] * mesh.shape[n] + c[n]
    others = [tuple(c[n] for n in mesh.axis_names if n not in names) for c in coords]
    members = [
        sorted((q for q in range(mesh.size) if others[q] == others[r]), key=index.__getitem__) for r in range(mesh.size)
    ]
    return index, members


def _check(per_rank_fn, reference, x_shape, seed=0):
    """Run ``per_rank_fn`` with rank ``r`` holding ``X[r]``; compare ``Y`` and ``dL/dX`` with ``reference``."""
    gen = torch.Generator().manual_seed(seed)
    with maybe_disable_local_tensor_mode():
        x_full = torch.randn(MESH.size, *x_shape, generator=gen).requires_grad_(True)
        y_ref = reference(x_full)
        cot = torch.randn(y_ref.shape, generator=gen)
        (g_ref,) = torch.autograd.grad((y_ref * cot).sum(), x_full)
    x = rank_map(lambda r: x_full[r].detach().clone()).requires_grad_(True)
    with bind_mesh(MESH):
        y = per_rank_fn(x)
    # Each rank's loss is its own sum; autograd adds their gradients up across ranks through the collectives.
    (g,) = torch.autograd.grad((y * rank_map(lambda r: cot[r])).sum(), x)
    for got, want in ((y, y_ref), (g, g_ref)):
        for r, v in enumerate(per_rank(got)):
            assert_close(v, want[r], msg=f"rank {r}")


@st.composite
def axis_names(draw, mesh=MESH):
    """One mesh axis as a string, or a tuple of distinct axes in any order (possibly empty)."""
    names = draw(st.permutations(mesh.axis_names))[: draw(st.integers(0, len(mesh.axis_names)))]
    if len(names) == 1 and draw(st.booleans()):
        return names[0]
    return tuple(names)


def _names(axis_name):
    return (axis_name,) if isinstance(axis_name, str) else axis_name


@settings(max_examples=10)
@given(axis_names(), st.booleans())
def test_psum_and_pmean(axis_name, mean):
    _, members = _groups(MESH, _names(axis_name))
    n = len(members[0])
    op = pmean if mean else psum

    def reference(x):
        return torch.stack([sum(x[q] for q in members[r]) / (n if mean else 1) for r in range(MESH.size)])

    _check(lambda t: op(t, axis_name), reference, (3,))


@settings(max_examples=12)
@given(axis_names(), st.integers(0, 2), st.booleans())
def test_all_gather(axis_name, axis, tiled):
    _, members = _groups(MESH, _names(axis_name))
    axis = min(axis, 1 if tiled else 2)
    join = torch.cat if tiled else torch.stack

    def reference(x):
        return torch.stack([join([x[q] for q in members[r]], axis) for r in range(MESH.size)])

    _check(lambda t: all_gather(t, axis_name, axis=axis, tiled=tiled), reference, (2, 3))


@settings(max_examples=12)
@given(axis_names(), st.integers(0, 1), st.booleans())
def test_psum_scatter(axis_name, dim, tiled):
    index, members = _groups(MESH, _names(axis_name))
    n = len(members[0])
    shape = [3, 3]
    shape[dim] = n * (2 if tiled else 1)

    def block(total, k):
        return total.chunk(n, dim)[k] if tiled else total.select(dim, k)

    def reference(x):
        return torch.stack([block(sum(x[q] for q in members[r]), index[r]) for r in range(MESH.size)])

    _check(lambda t: psum_scatter(t, axis_name, scatter_dimension=dim, tiled=tiled), reference, shape)


@settings(max_examples=15)
@given(axis_names(), st.integers(0, 2), st.integers(0, 2), st.booleans())
def test_all_to_all(axis_name, split, concat, tiled):
    index, members = _groups(MESH, _names(axis_name))
    n = len(members[0])
    shape = [2, 3, 2]
    shape[split] = n * (2 if tiled else 1)

    def received(x, r):
        if tiled:
            return torch.cat([x[q].chunk(n, split)[index[r]] for q in members[r]], concat)
        return torch.stack([x[q].select(split, index[r]) for q in members[r]], concat)

    def reference(x):
        return torch.stack([received(x, r) for r in range(MESH.size)])

    _check(lambda t: all_to_all(t, axis_name, split, concat, tiled=tiled), reference, shape)


def _ppermute_case(axis_name, perm):
    index, members = _groups(MESH, _names(axis_name))
    src_of = {d: s for s, d in perm}

    def reference(x):
        rows = []
        for r in range(MESH.size):
            k = index[r]
            rows.append(x[members[r][src_of[k]]] if k in src_of else 0 * x[r])
        return torch.stack(rows)

    _check(lambda t: ppermute(t, axis_name, perm), reference, (2, 3))


@pytest.mark.parametrize("axis_name", ["b", ("c", "a"), ("a", "b", "c")])
def test_ppermute_ring(axis_name):
    n = MESH.axis_size(_names(axis_name))
    _ppermute_case(axis_name, [(i, (i + 1) % n) for i in range(n)])


@pytest.mark.parametrize(
    ("axis_name", "perm"),
    [("a", [(0, 1)]), (("b", "c"), [(0, 3), (3, 1)]), (("c", "b", "a"), [(1, 0), (2, 2), (7, 5)]), ("b", [])],
)
def test_ppermute_partial(axis_name, perm):
    _ppermute_case(axis_name, perm)


@settings(max_examples=8)
@given(st.data())
def test_ppermute_random_perm(data):
    axis_name = data.draw(axis_names())
    n = MESH.axis_size(_names(axis_name))
    dsts = data.draw(st.permutations(range(n)))
    keep = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    _ppermute_case(axis_name, [(s, d) for s, d, k in zip(range(n), dsts, keep) if k])


@pytest.mark.parametrize("axis_name", ["c", ("b", "a"), ()])
def test_axis_index_and_size(axis_name):
    index, members = _groups(MESH, _names(axis_name))
    with bind_mesh(MESH):
        assert [int(k) for k in per_rank(axis_index(axis_name))] == index
        assert axis_size(axis_name) == len(members[0])


class _SeenOps(TorchDispatchMode):
    """Records the ``_c10d_functional`` collectives dispatched (what the comms accounting intercepts)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name not in ("wait_tensor", "_wrap_tensor_autograd"):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("collective", "op"),
    [
        (lambda t: psum(t, ("a", "c")), "all_reduce"),
        (lambda t: all_gather(t, ("c", "a")), "all_gather_into_tensor"),
        (lambda t: psum_scatter(t, ("a", "c"), tiled=True), "reduce_scatter_tensor"),
        (lambda t: all_to_all(t, ("a", "c"), 0, 0, tiled=True), "all_to_all_single"),
        (lambda t: ppermute(t, ("a", "c"), [(0, 1), (1, 0)]), "all_to_all_single"),
    ],
)
def test_lowers_to_one_functional_collective_on_a_labelled_group(collective, op):
    x = torch.ones(4, 2)
    with bind_mesh(MESH), _SeenOps() as seen:
        collective(x)
    assert seen.ops == [op]
    assert axis_of_group(MESH.device_mesh[("a", "c")]._flatten().get_group().group_name) == "a+c"


def test_size_one_axes_are_free():
    mesh = Mesh(a=1, b=8)
    x = rank_map(lambda r: torch.full((2,), float(r))).requires_grad_(True)
    with bind_mesh(mesh), _SeenOps() as seen:
        y = all_gather(psum(x, "a"), ("a",), tiled=True)
        z = ppermute(all_to_all(y, (), 0, 0, tiled=True), "a", [(0, 0)])
        (g,) = torch.autograd.grad((z * z).sum(), x)
    assert seen.ops == []
    assert [v.tolist() for v in per_rank(z)] == [v.tolist() for v in per_rank(x)]
    assert [v.tolist() for v in per_rank(g)] == [(2 * v).tolist() for v in per_rank(x)]


def test_collective_outside_shard_map_raises():
    with pytest.raises(RuntimeError, match=r"psum\('tp'\) called outside shard_map.*Fix: call psum inside"):
        psum(torch.ones(2), "tp")
    with pytest.raises(RuntimeError, match=r"axis_index\(\('dp', 'tp'\)\) called outside shard_map"):
        axis_index(("dp", "tp"))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda t: psum(t, "tp"), r"mesh Mesh\(a=2, b=2, c=2\): psum\('tp'\): unknown mesh axis 'tp'"),
        (lambda t: all_gather(t, ("a", "x")), r"all_gather\(\('a', 'x'\)\): unknown mesh axis 'x'"),
        (lambda t: pmean(t, ("a", "a")), r"an axis appears twice"),
        (lambda t: psum_scatter(t, "a"), r"dim 0 has size 4, expected exactly 2"),
        (lambda t: all_to_all(t, "a", 1, 0, tiled=True), r"dim 1 has size 3, expected a multiple of 2"),
        (lambda t: all_gather(t, "a", axis=3), r"axis=3 is out of range"),
        (lambda t: ppermute(t, "b", [(0, 1), (1, 1)]), r"destination index 1 more than once"),
        (lambda t: ppermute(t, "b", [(0, 2)]), r"destination index 2 out of range"),
    ],
)
def test_bad_arguments_name_the_mesh_and_the_fix(call, message):
    with bind_mesh(MESH), pytest.raises(ShardingError, match=message) as info:
        call(torch.ones(4, 3))
    assert "Fix: " in str(info.value)
