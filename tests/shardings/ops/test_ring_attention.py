"""shardings.ops.ring_attention: ring and all-gather attention equal the reference (values, grads), their
collectives, and the zigzag load balance."""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import core
import shardings
from shardings import Mesh, P, Rules, ShardingError, comms, per_rank, shard, use
from shardings.ops.ring_attention import _zigzag_perms, attention, reference_attention, ring_work
from shardings.spec import layouts
from shardings.testing import assert_close


def _inputs(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, head_dim, generator=gen)
    k, v = (torch.randn(batch, seq, kv_heads, head_dim, generator=gen) for _ in range(2))
    return q, k, v, torch.randn(batch, seq, heads, head_dim, generator=gen)


def _reference(q, k, v, cotangent, causal):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = reference_attention(q, k, v, causal=causal)
    return out.detach(), torch.autograd.grad(out, (q, k, v), cotangent)


def _sharded(q, k, v, cotangent, causal, mesh, layout, spec, wrap=lambda f: f):
    """attention(...) under ``use(mesh, layout)`` on inputs laid out by ``spec``; full values on every rank."""
    with use(mesh, layout):
        args = [shard(x, spec, mesh).requires_grad_() for x in (q, k, v)]
        out = wrap(functools.partial(attention, causal=causal))(*args)
        grads = torch.autograd.grad(out, args, shard(cotangent, spec, mesh))
    return [per_rank(x.full_tensor()) for x in (out, *grads)]


def _assert_close(got_per_rank, want_tensors):
    for got, want in zip(got_per_rank, want_tensors):
        for rank_value in got:
            assert_close(rank_value, want)


@pytest.mark.parametrize("variant", ["cp", "cp_allgather"])
@pytest.mark.parametrize("cp", [2, 4, 8])
@settings(max_examples=4)
@given(causal=st.booleans(), heads=st.sampled_from([(2, 2), (4, 2), (2, 1)]), chunk=st.integers(1, 2),
       batch=st.integers(1, 2))
def test_equals_reference_values_and_grads(variant, cp, causal, heads, chunk, batch):
    seq = 2 * cp * chunk  # splits into 2·cp zigzag chunks
    q, k, v, cot = _inputs(batch, seq, *heads)
    want_out, want_grads = _reference(q, k, v, cot, causal)
    with shardings.simulate(cp):
        got = _sharded(q, k, v, cot, causal, Mesh(cp=cp), layouts.get(variant), P(None, "cp"))
    _assert_close(got, (want_out, *want_grads))


@pytest.mark.parametrize("kv_heads", [2, 1])  # 1: kv heads cannot follow tp, they are repeated first
def test_composes_with_heads_on_tp_and_batch_on_dp(kv_heads):
    q, k, v, cot = _inputs(2, 8, 2, kv_heads)
    want = _reference(q, k, v, cot, True)
    with shardings.simulate(8):
        mesh = Mesh(dp=2, cp=2, tp=2)
        got = _sharded(q, k, v, cot, True, mesh, layouts.get("dp+tp+cp"), P("dp", "cp"))
    _assert_close(got, (want[0], *want[1]))


def test_under_remat_the_ring_runs_again_in_backward():
    q, k, v, cot = _inputs(1, 8, 2, 1)
    want = _reference(q, k, v, cot, True)
    with shardings.simulate(2):
        got = _sharded(q, k, v, cot, True, Mesh(cp=2), layouts.get("cp"), P(None, "cp"), wrap=core.remat)
    _assert_close(got, (want[0], *want[1]))


def test_without_cp_it_is_the_fused_kernel_on_each_ranks_blocks():
    q, k, v, _ = _inputs(2, 6, 2, 1)
    want = reference_attention(q, k, v)
    assert_close(attention(q, k, v), want)  # no mesh
    with shardings.simulate(2), use(Mesh(dp=2), layouts.get("dp")):
        got = attention(*(shard(x, P("dp"), Mesh(dp=2)) for x in (q, k, v)))
        assert got.placements[0].is_shard(0)  # dp-sharded blocks, no ring
        assert_close(per_rank(got.full_tensor())[1], want)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_passes_kv_cp_minus_one_times_forward_and_kv_dkv_in_backward(cp):
    batch, seq, heads, kv_heads, head_dim = 1, 4 * cp, 4, 2, 4
    q, k, v, cot = _inputs(batch, seq, heads, kv_heads, head_dim)
    kv_bytes = 2 * batch * (seq // cp) * kv_heads * head_dim * 4  # K and V blocks of one rank, fp32
    with shardings.simulate(cp):
        mesh = Mesh(cp=cp)
        assert mesh.device_mesh is not None  # built before counting: building may broadcast
        with use(mesh, layouts.get("cp")):
            args = [shard(x, P(None, "cp"), mesh).requires_grad_() for x in (q, k, v)]
            with comms() as fwd:
                out = attention(*args)
            with comms() as bwd:
                torch.autograd.grad(out, args, shard(cot, P(None, "cp"), mesh))
    # the zigzag relayout is ppermutes too (q, k and v in as one, the output back; their transposes in backward):
    # two per chunk permutation that moves data, of half a rank's blocks each
    moved = sum(any(s != d for s, d in perm) for perm in _zigzag_perms(cp))
    half = batch * (seq // cp // 2) * head_dim * 4
    zigzag = (2 * moved, moved * half * (2 * heads + 2 * kv_heads))
    ring = lambda sends, blocks: [{"kind": "ppermute", "axis": "cp", "count": sends + zigzag[0],
                                   "bytes": blocks * kv_bytes + zigzag[1]}]
    assert fwd.rows() == ring(cp - 1, cp - 1)  # nothing else: the ring and the relayout are all the traffic
    # backward: K/V travel cp-1 steps again with the dK/dV accumulators in the same message (so that a compiled
    # step re-sends them in backward too: ring_attention._pack), and dK/dV one step more, alone (home)
    assert bwd.rows() == ring(cp, 2 * cp - 1)


def test_a_bfloat16_ring_sends_its_fp32_gradient_accumulators_with_its_kv():
    # K/V in bf16 and dK/dV in fp32 travel as one message of their bytes: values, grads and bytes as they should be
    cp, batch, seq, heads, kv_heads, head_dim = 2, 1, 8, 2, 1, 4
    q, k, v, cot = (x.to(torch.bfloat16) for x in _inputs(batch, seq, heads, kv_heads, head_dim))
    want_out, want_grads = _reference(*(x.double() for x in (q, k, v, cot)), True)
    with shardings.simulate(cp):
        mesh = Mesh(cp=cp)
        assert mesh.device_mesh is not None
        with comms() as bwd:
            got = _sharded(q, k, v, cot, True, mesh, layouts.get("cp"), P(None, "cp"))
    for got_ranks, want in zip(got, (want_out, *want_grads)):
        for rank_value in got_ranks:
            assert rank_value.dtype == torch.bfloat16
            assert_close(rank_value.double(), want, dtype=torch.bfloat16, terms=seq)
    block = batch * (seq // cp) * kv_heads * head_dim  # one rank's K (or V, dK, dV) block, elements
    ring = [r for r in bwd.rows() if r["kind"] == "ppermute"]
    zigzag_bytes = 2 * 2 * batch * (seq // cp // 2) * (2 * heads + 2 * kv_heads) * head_dim  # bf16 half blocks
    # forward: K+V once (bf16); backward: K+V (bf16) with dK+dV (fp32), then dK+dV alone; the zigzag's 2 each way
    assert ring == [{"kind": "ppermute", "axis": "cp", "count": 1 + 2 + 2 * 2,
                     "bytes": 2 * block * 2 + (2 * block * 2 + 2 * block * 4) + 2 * block * 4 + zigzag_bytes}]


def test_allgather_variant_gathers_kv_and_reduce_scatters_their_grads():
    cp, batch, seq, kv_heads, head_dim = 2, 1, 8, 1, 4
    q, k, v, cot = _inputs(batch, seq, 2, kv_heads, head_dim)
    full = batch * seq * kv_heads * head_dim * 4  # one gathered K (or V), fp32
    with shardings.simulate(cp):
        mesh = Mesh(cp=cp)
        assert mesh.device_mesh is not None
        with use(mesh, layouts.get("cp_allgather")):
            args = [shard(x, P(None, "cp"), mesh).requires_grad_() for x in (q, k, v)]
            with comms() as c:
                torch.autograd.grad(attention(*args), args, shard(cot, P(None, "cp"), mesh))
    assert c.rows() == [
        {"kind": "all_gather", "axis": "cp", "count": 2, "bytes": full},  # (cp-1)/cp of each of K, V
        {"kind": "reduce_scatter", "axis": "cp", "count": 2, "bytes": full},
    ]


@given(st.integers(1, 16))
def test_causal_zigzag_work_is_equal_on_every_rank(cp):
    work = ring_work(cp)
    chunks = 2 * cp
    assert sum(work) == chunks * (chunks + 1) // 2  # every unmasked chunk pair of the causal grid, once
    assert max(work) - min(work) <= 1 and work == [chunks + 1] * cp  # equal (within one chunk: exactly)
    assert ring_work(cp, causal=False) == [chunks * 2] * cp
    contiguous = [sum(min(q + 1, chunks) for q in (2 * r, 2 * r + 1)) for r in range(cp)]
    assert cp == 1 or max(contiguous) - min(contiguous) > 1  # what the zigzag order fixes


def test_errors_name_the_problem_and_the_fix():
    q, k, v, _ = _inputs(1, 6, 2, 2)
    with shardings.simulate(2):
        mesh = Mesh(cp=2)
        with use(mesh, layouts.get("cp")), pytest.raises(ShardingError, match=r"multiple of 4.*Fix:"):
            attention(q, k, v)  # 6 tokens do not split into 2·cp = 4 chunks
    with shardings.simulate(4):
        rules = Rules([("seq", "cp"), ("kv_seq", "dp")]) + layouts.get("cp").activation_rules
        with use(Mesh(dp=2, cp=2), rules), pytest.raises(ShardingError, match=r"kv_seq on \('dp',\).*Fix:"):
            attention(*_inputs(1, 8, 2, 2)[:3])  # K/V seq on another axis than the query's
    with pytest.raises(ShardingError, match=r"needs a mesh axis cp.*Fix:"):
        layouts.validate(layouts.get("dp+cp"), Mesh(dp=2))
    with pytest.raises(ShardingError, match="two cp strategies"):
        layouts.get("cp+cp_allgather")
