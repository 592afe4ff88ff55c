"""``blockwise``: values and gradients equal the function on full tensors, whatever the layout; when the
layout splits only independent rows it runs on the local blocks (its own autograd node, no collective)
and keeps ``x``'s layout; otherwise it falls back to the DTensor ops, still exact."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from shardings import Mesh, P, blockwise, comms, shard, simulate, spec_of, unwrap
from shardings.testing import assert_close, meshes, specs


def _norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """RMSNorm over the last dim: mixes the last dim, rows independent."""
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


def _by_position(x: torch.Tensor) -> torch.Tensor:
    """Scales each position of dim 1 by its index (as RoPE rotates by position): needs dim 1 whole."""
    pos = x.new_ones(x.shape[1]).cumsum(0)
    return x * pos[:, None]


def _rotate(x: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """Rotates the two halves of the last dim by an angle per position of dim 1 (RoPE's shape): linear in x,
    its transpose the rotation back (``sign=-1``)."""
    angle = sign * x.new_ones(x.shape[1]).cumsum(0)[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()), dim=-1)


KINDS = {  # f, whole, weight?, transpose
    "norm": (_norm, (-1,), True, None),
    "position": (_by_position, (1,), False, None),
    "rotation": (_rotate, (1, -1), False, lambda g: _rotate(g, -1.0)),
}


@st.composite
def _cases(draw):
    mesh = draw(meshes(max_ranks=8, axis_names=("dp", "tp", "cp")))
    rows = (draw(st.integers(1, 3)) * draw(st.sampled_from([1, 2, 4])) for _ in range(2))
    shape = (*rows, 4)  # the last dim even: _rotate splits it in halves
    return mesh, torch.randn(shape), draw(specs(shape, mesh)), draw(st.sampled_from(sorted(KINDS)))


@settings(max_examples=30)
@given(_cases())
@example((Mesh(dp=2), torch.tensor([[[1.5410, -0.2934, -2.1788, 0.5684]]]), P("dp"), "norm"))  # explore: 1 row, 2 ranks
@example((Mesh(dp=1, tp=2, cp=2), torch.randn(2, 2, 4), P(("tp", "cp"), None), "position"))  # explore: 2 rows, tp×cp
@example((Mesh(dp=1, tp=2, cp=2), torch.randn(2, 1, 4), P(("dp", "tp", "cp"), None), "position"))  # explore: 2 rows, 4
@example((Mesh(dp=2, tp=2), torch.randn(1, 4, 4), P(None, ("tp", "dp")), "norm"))  # explore: axes against mesh order
def test_blockwise_equals_the_function_on_full_tensors_and_is_local_when_only_rows_are_split(case):
    mesh, full, spec, kind = case
    f, whole, weighted, transpose = KINDS[kind]
    args = [torch.randn(full.shape[-1])] if weighted else []
    leaves = [full.clone().requires_grad_(), *(a.clone().requires_grad_() for a in args)]
    want = f(*leaves)
    cotangent = torch.randn_like(want)
    want_grads = torch.autograd.grad((want * cotangent).sum(), leaves)
    with simulate(mesh.size):
        xs = [shard(full, spec, mesh).detach().requires_grad_(), *(shard(a, P(), mesh).requires_grad_() for a in args)]
        with comms() as forward:
            out = blockwise(f, *xs, whole=whole, transpose=transpose)
        assert_close(unwrap(out.full_tensor()), want)
        (out.full_tensor() * cotangent).sum().backward()
        for x, g in zip(xs, want_grads):
            assert_close(unwrap(x.grad.full_tensor()), g)
        split = {d % full.ndim for d, axes in enumerate(spec.dim_axes()) if mesh.axis_size(axes) > 1}
        even = all(full.shape[d] % mesh.axis_size(axes) == 0 for d, axes in enumerate(spec.dim_axes()))
        # an entry naming axes against the mesh's order (P(None, ("tp", "dp")) on Mesh(dp, tp)) is a strided shard
        # in DTensor: interleaved rows, left to DTensor ops (exact, not local)
        real = [[a for a in axes if mesh.axis_size(a) > 1] for axes in spec.dim_axes()]  # size-1 axes split nothing
        in_order = all(axes == sorted(axes, key=mesh.axis_names.index) for axes in real)
        local = even and in_order and not split & {d % full.ndim for d in whole}  # uneven blocks: DTensor ops
        assert (type(out.grad_fn).__name__ == "_BlockwiseBackward") == local
        if local:
            assert spec_of(out) == spec_of(xs[0]) and forward.rows() == []


def test_plain_tensors_are_the_function_itself():
    x, w = torch.randn(2, 3), torch.randn(3)
    assert torch.equal(blockwise(_norm, x, w, whole=(-1,)), _norm(x, w))


def test_a_transpose_with_more_inputs_than_x_is_a_clear_error():
    with pytest.raises(ValueError, match="transpose is for a function of x alone, but 1 more inputs"):
        blockwise(_norm, torch.randn(2, 3), torch.randn(3), whole=(-1,), transpose=lambda g: g)


def test_a_function_that_changes_the_block_shape_is_a_clear_error():
    with simulate(2):
        x = shard(torch.randn(4, 6), P("dp"), Mesh(dp=2))
        with pytest.raises(ValueError, match=r"f returned a block of shape \(2, 3\).*\(2, 6\).*keep the shape"):
            blockwise(lambda t: t[:, :3], x, whole=(-1,))
