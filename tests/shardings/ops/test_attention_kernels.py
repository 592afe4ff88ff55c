"""shardings.ops.attention_kernels: the fused kernels equal the einsum reference (values, grads), GQA reads K/V
groups in place, and every layout path runs the kernel on local blocks (tp: no communication)."""

import contextlib

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import shardings
from shardings import Mesh, P, comms, per_rank, shard, use
from shardings.ops import attention_kernels as kernels
from shardings.ops.ring_attention import attention, reference_attention
from shardings.spec import layouts
from shardings.testing import assert_close

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class _Calls(TorchDispatchMode):
    """Records the (query, key) shapes of every CPU flash-attention call, forward and backward."""

    def __init__(self):
        super().__init__()
        self.shapes: dict[object, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {_FLASH: [], _FLASH_BWD: []}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.shapes:
            q, k = (args[0], args[1]) if func is _FLASH else (args[1], args[2])
            self.shapes[func].append((tuple(q.shape), tuple(k.shape)))
        return func(*args, **(kwargs or {}))


def _inputs(batch, seq, heads, kv_heads, head_dim=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(batch, seq, h, head_dim, generator=gen).to(dtype)
    return make(heads), make(kv_heads), make(kv_heads), make(heads)


def _value_and_grads(f, q, k, v, cot):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = f(q, k, v)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), cot)]


@settings(max_examples=12)
@given(causal=st.booleans(), heads=st.sampled_from([(4, 4), (4, 2), (4, 1)]), seq=st.integers(1, 40),
       dtype=st.sampled_from([torch.float32, torch.float64]))
@example(causal=True, heads=(4, 4), seq=1, dtype=torch.float32)  # one key: the reference's dq and dk are exactly 0
def test_fused_equals_the_reference(causal, heads, seq, dtype):
    q, k, v, cot = _inputs(2, seq, *heads, dtype=dtype)
    got = _value_and_grads(lambda *a: kernels.fused(*a, causal=causal), q, k, v, cot)
    # the reference's softmax is float32: compare both at float32's precision, each grad a sum over seq
    want = _value_and_grads(lambda *a: reference_attention(*a, causal=causal), q, k, v, cot)
    assert_close(got, want, terms=seq, dtype=torch.float32)


def test_over_one_key_rounding_where_the_reference_is_zero_passes_and_a_real_error_fails():
    """Softmax over one key has zero gradient for q and k; a kernel computes it as dP − rowsum(dO·O), two dot
    products that cancel: 2.2e-7 on one CPU, exactly 0 on another. The rule judges such a leaf on the floor of
    its tree (8 ulps of the largest value of [out, dq, dk, dv]), not on its own size 0."""
    q, k, v, cot = _inputs(2, 1, 4, 2)
    want = _value_and_grads(lambda *a: reference_attention(*a, causal=True), q, k, v, cot)
    assert not want[1].any() and not want[2].any()  # exactly 0: nothing of their own to scale an allowance by
    noise = torch.full_like(want[1], 2e-7) * torch.tensor([1.0, -1.0]).repeat(want[1].numel() // 2).view_as(want[1])
    assert_close([want[0], noise, want[2] - 2e-7, want[3]], want, terms=1, dtype=torch.float32)
    with pytest.raises(AssertionError, match=r"at \[1\]"):  # an error far above the rounding of the tree
        assert_close([want[0], noise * 100, want[2], want[3]], want, terms=1, dtype=torch.float32)
    with pytest.raises(AssertionError, match=r"at \[3\]"):  # and the leaves of their own scale stay strict
        assert_close([want[0], noise, want[2], want[3] * (1 + 1e-4)], want, terms=1, dtype=torch.float32)


def test_fused_in_bfloat16_is_the_float32_reference_to_bfloat16_rounding():
    q, k, v, cot = _inputs(2, 64, 4, 2, dtype=torch.bfloat16)
    got = _value_and_grads(lambda *a: kernels.fused(*a, causal=True), q, k, v, cot)
    want = _value_and_grads(lambda *a: reference_attention(*a, causal=True), *(x.float() for x in (q, k, v, cot)))
    # bfloat16 rounds inputs, probabilities and outputs: its eps, each grad a sum over seq
    assert_close([g.float() for g in got], want, terms=64, dtype=torch.bfloat16)


def test_blocks_merged_by_log_sum_exp_equal_the_whole():
    """Two key blocks of a causal row block, merged by lse; the backward from the merged out/lse: exact parts."""
    q, k, v, cot = _inputs(1, 16, 4, 2)
    scale, half = 8**-0.5, 8
    want = _value_and_grads(lambda *a: reference_attention(*a, causal=True), q, k, v, cot)
    o1, l1 = kernels.block_forward(q[:, half:], k[:, :half], v[:, :half], False, scale)  # past keys: no mask
    o2, l2 = kernels.block_forward(q[:, half:], k[:, half:], v[:, half:], True, scale)  # the diagonal: causal
    lse = torch.logaddexp(l1, l2)
    w = lambda l: torch.exp(l - lse).transpose(1, 2)[..., None]  # noqa: E741
    out = o1 * w(l1) + o2 * w(l2)
    assert_close(out, want[0][:, half:], terms=16)
    dq1, dk1, _ = kernels.block_backward(cot[:, half:], q[:, half:], k[:, :half], v[:, :half], out, lse, False, scale)
    dq2, dk2, dv2 = kernels.block_backward(cot[:, half:], q[:, half:], k[:, half:], v[:, half:], out, lse, True, scale)
    assert dk1.shape == (1, half, 2, 8)  # kv heads as given: groups summed by the kernel
    assert_close(dq1 + dq2, want[1][:, half:], terms=16)
    # keys of the second half are seen by the second half's queries only
    assert_close(dk2, want[2][:, half:], terms=16)
    assert_close(dv2, want[3][:, half:], terms=16)


def test_gqa_reads_kv_groups_in_place():
    q, k, v, cot = _inputs(1, 16, 8, 2)
    with _Calls() as calls:
        _value_and_grads(lambda *a: kernels.fused(*a, causal=True), q, k, v, cot)
    (fwd,), (bwd,) = calls.shapes[_FLASH], calls.shapes[_FLASH_BWD]
    assert fwd == bwd == ((1, 8, 16, 8), (1, 2, 16, 8))  # (b, heads, s, d) queries against 2 kv heads, not 8


@contextlib.contextmanager
def _simulated(layout, **axes):
    mesh = Mesh(**axes)
    with shardings.simulate(mesh.size), use(mesh, layouts.get(layout)):
        assert mesh.device_mesh is not None  # built before counting: building may broadcast
        yield mesh


def test_under_tp_each_rank_runs_the_kernel_on_its_heads_without_communication():
    q, k, v, cot = _inputs(2, 12, 4, 2)
    want = _value_and_grads(lambda *a: reference_attention(*a, causal=True), q, k, v, cot)
    with _simulated("dp+tp", dp=2, tp=2) as mesh:
        spec = P("dp", None, "tp")
        args = [shard(x, spec, mesh).requires_grad_() for x in (q, k, v)]
        with _Calls() as calls, comms() as c:
            out = attention(*args)
            grads = torch.autograd.grad(out, args, shard(cot, spec, mesh))
        got = [per_rank(x.full_tensor()) for x in (out, *grads)]
    assert c.rows() == []
    # one call on the simulated ranks' local blocks (a LocalTensor runs it per rank):
    # batch 2/dp, heads 4/tp against kv heads 2/tp
    assert calls.shapes[_FLASH] == calls.shapes[_FLASH_BWD] == [((1, 2, 12, 8), (1, 1, 12, 8))]
    for rank_values, w in zip(got, want):
        for g in rank_values:
            assert_close(g, w, terms=12)


@pytest.mark.parametrize("cp", [2, 4])
def test_under_cp_the_ring_runs_the_kernel_on_each_block(cp):
    chunk, seq = 3, 2 * cp * 3
    q, k, v, cot = _inputs(1, seq, 4, 2)
    with _simulated("cp", cp=cp) as mesh:
        spec = P(None, "cp")
        args = [shard(x, spec, mesh).requires_grad_() for x in (q, k, v)]
        with _Calls() as calls:
            torch.autograd.grad(attention(*args), args, shard(cot, spec, mesh))
    # per rank and ring step: the diagonal (2 chunks × 2 chunks) or two chunk-pair blocks as one call
    blocks = {((1, 4, 2 * chunk, 8), (1, 2, 2 * chunk, 8)), ((1, 4, chunk, 8), (1, 2, 2 * chunk, 8)),
              ((1, 4, 2 * chunk, 8), (1, 2, chunk, 8))}
    for op in (_FLASH, _FLASH_BWD):
        assert len(calls.shapes[op]) == cp * cp  # cp ranks × cp ring steps
        assert set(calls.shapes[op]) <= blocks
