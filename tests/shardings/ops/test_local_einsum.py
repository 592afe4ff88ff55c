"""The local-shard einsum: values and gradients equal the full-tensor einsum, with no forward collective when
the operands' layouts agree, and the einops fallback (still exact) when they do not."""

import einops
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from shardings import Mesh, P, comms, einsum, shard, simulate, spec_of, unwrap
from shardings.ops.local_einsum import _plan_for
from shardings.residency.gather_params import regather_in_backward, to_compute
from shardings.testing import assert_close, meshes

# (pattern, size of each index): linear layers, attention scores, experts, an index summed in one operand only
PATTERNS = [
    ("b s e, e h d -> b s h d", {"b": 2, "s": 4, "e": 3, "h": 4, "d": 2}),
    ("b s h d, h d e -> b s e", {"b": 2, "s": 4, "h": 2, "d": 3, "e": 5}),
    ("b s h d, b t h d -> b h s t", {"b": 2, "s": 3, "t": 4, "h": 2, "d": 2}),
    ("x t e, x e f -> x t f", {"x": 4, "t": 3, "e": 2, "f": 6}),
    ("a b, b c -> a", {"a": 5, "b": 4, "c": 3}),
    ("b s k e, b s k -> b s e", {"b": 2, "s": 4, "k": 2, "e": 3}),
]


def _terms(pattern: str) -> tuple[list[list[str]], list[str]]:
    lhs, rhs = pattern.split("->")
    return [t.split() for t in lhs.split(",")], rhs.split()


# Blocks sum a contraction in another order than the full einsum: a sum of n O(1) terms moves by up to about
# n·eps·Σ|terms|, and the widest here (an input grad over f = 6 per rank × 6 ranks) reaches ~1e-5. At


def _check(pattern: str, fulls: list[torch.Tensor], specs: list[P], mesh: Mesh) -> DTensor:
    """Values and grads of ``einsum`` on ``shard(fulls, specs)`` equal ``einops.einsum`` on ``fulls``."""
    leaves = [t.clone().requires_grad_() for t in fulls]
    want = einops.einsum(*leaves, pattern)
    cotangent = torch.randn_like(want)
    want_grads = torch.autograd.grad((want * cotangent).sum(), leaves)
    xs = [shard(t, s, mesh).detach().requires_grad_() for t, s in zip(fulls, specs)]
    out = einsum(*xs, pattern)
    assert_close(unwrap(out.full_tensor()), want)
    (out.full_tensor() * cotangent).sum().backward()
    for x, g in zip(xs, want_grads):
        assert_close(unwrap(x.grad.full_tensor()), g)
    return out


@st.composite
def _cases(draw):
    """A pattern, a mesh, and specs that split each index the same way in every operand (JAX-style), then
    maybe one operand's split dropped (an inconsistent layout: the fallback must still be exact)."""
    pattern, sizes = draw(st.sampled_from(PATTERNS))
    mesh = draw(meshes(max_ranks=8, axis_names=("dp", "cp", "tp")))
    letter_axes = {k: [] for k in sizes}
    for name in draw(st.permutations(mesh.axis_names)):  # a tuple out of mesh order is a _StridedShard
        letter = draw(st.sampled_from([None, *sizes]))
        if letter is not None:
            letter_axes[letter].append(name)
    sizes = {k: n * mesh.axis_size(tuple(letter_axes[k])) for k, n in sizes.items()}  # even (uneven: see below)
    inputs, _ = _terms(pattern)
    specs = [[tuple(letter_axes[k]) or None for k in letters] for letters in inputs]
    consistent = draw(st.booleans())
    if not consistent:
        i = draw(st.integers(0, len(specs) - 1))
        split = [d for d, axes in enumerate(specs[i]) if axes and mesh.axis_size(axes) > 1]
        if not split or not any(inputs[i][split[0]] in other for j, other in enumerate(inputs) if j != i):
            consistent = True  # nothing to break: no index split (size-1 axes are free), or in this operand only
        else:
            specs[i][split[0]] = None
    fulls = [torch.randn(*(sizes[k] for k in letters)) for letters in inputs]
    return pattern, fulls, [P(*s) for s in specs], mesh, consistent


@settings(max_examples=20)
@given(case=_cases())
def test_matches_full_einsum_on_random_layouts(case):
    pattern, fulls, specs, mesh, consistent = case
    with simulate(mesh.size):
        xs = [shard(t, s, mesh) for t, s in zip(fulls, specs)]
        assert (_plan_for(pattern, xs) is not None) == consistent
        if consistent:
            with comms() as c:
                einsum(*xs, pattern)
            assert c.rows() == []  # the local path communicates nothing in forward
        _check(pattern, fulls, specs, mesh)


def test_plain_tensors_are_exactly_einops():
    a, b = torch.randn(2, 3, 4), torch.randn(4, 5, 6)
    assert torch.equal(einsum(a, b, "b s e, e h d -> b s h d"), einops.einsum(a, b, "b s e, e h d -> b s h d"))


def test_column_parallel_keeps_heads_split_and_gives_a_partial_input_grad():
    with simulate(4):
        mesh = Mesh(dp=2, tp=2)
        h, w = torch.randn(4, 2, 3), torch.randn(3, 4, 2)
        out = _check("b s e, e h d -> b s h d", [h, w], [P("dp"), P(None, "tp")], mesh)
        assert spec_of(out) == P("dp", None, "tp")
        hs = shard(h, P("dp"), mesh).requires_grad_()
        einsum(hs, shard(w, P(None, "tp"), mesh), "b s e, e h d -> b s h d").sum().backward()
        assert hs.grad.placements == (Shard(0), Partial())  # each tp rank saw its heads only


def test_row_parallel_output_is_partial_over_the_contracted_axis():
    with simulate(4):
        mesh = Mesh(dp=2, tp=2)
        out = _check("b s h d, h d e -> b s e", [torch.randn(2, 4, 4, 2), torch.randn(4, 2, 3)],
                     [P("dp", None, "tp"), P("tp")], mesh)
        assert out.placements == (Shard(0), Partial())


def test_batch_and_seq_on_data_axes_of_a_3d_mesh():
    """The zero3+tp+sp+cp projection: b on dp, s on cp, heads on tp (DTensor's own einsum takes minutes here)."""
    with simulate(8):
        mesh = Mesh(dp=2, cp=2, tp=2)
        out = _check("b s e, e h d -> b s h d", [torch.randn(2, 4, 3), torch.randn(3, 2, 2)],
                     [P("dp", "cp"), P(None, "tp")], mesh)
        assert spec_of(out) == P("dp", "cp", "tp")
        out = _check("b s h d, h d e -> b s e", [torch.randn(2, 4, 2, 2), torch.randn(2, 2, 3)],
                     [P("dp", "cp", "tp"), P("tp")], mesh)
        assert out.placements == (Shard(0), Shard(1), Partial())


@pytest.mark.parametrize(("why", "specs"), [
    ("an uneven split", [P(None, "tp"), P()]),
    ("one index split two ways", [P(None, None, "tp"), P("dp")]),
    ("two indices on one axis", [P("tp"), P(None, "tp")]),
    ("an index split in one operand only", [P(None, None, "tp"), P()]),
])
def test_inconsistent_layouts_fall_back_exactly(why, specs):
    with simulate(4):
        mesh = Mesh(dp=2, tp=2)
        fulls = [torch.randn(2, 3, 4), torch.randn(4, 2, 2)]
        assert _plan_for("b s e, e h d -> b s h d", [shard(t, s, mesh) for t, s in zip(fulls, specs)]) is None, why
        _check("b s e, e h d -> b s h d", fulls, specs, mesh)


def test_partial_operand_falls_back_exactly():
    with simulate(2):
        mesh = Mesh(tp=2)
        a, b = torch.randn(3, 4), torch.randn(4, 2)
        halves = DTensor.from_local(a / 2, mesh.device_mesh, [Partial()])  # sums to a
        b_rep = shard(b, P(), mesh)
        assert _plan_for("i j, j k -> i k", [halves, b_rep]) is None
        out = einsum(halves, b_rep, "i j, j k -> i k")
        assert_close(unwrap(out.full_tensor()), a @ b)


def test_zero3_gathered_weight_is_regathered_in_backward_not_kept():
    """The local path saves its DTensor operands, so ZeRO-3's saved-tensor hook still swaps a gathered
    weight for its shard and gathers it again in backward (one all-gather), as DTensor's einsum did."""
    with simulate(2):
        mesh = Mesh(dp=2)
        w = shard(torch.randn(4, 3), P("dp"), mesh).requires_grad_()
        x = shard(torch.randn(2, 4), P("dp"), mesh).requires_grad_()
        with regather_in_backward():
            out = einsum(x, to_compute(w, (Replicate(),)), "b e, e f -> b f")
        with comms() as c:
            torch.autograd.grad(out, [x, w], shard(torch.randn(2, 3), P("dp"), mesh))
        rows = {(r["kind"], r["axis"]): r["count"] for r in c.rows()}
        assert rows == {("all_gather", "dp"): 1, ("reduce_scatter", "dp"): 1}
