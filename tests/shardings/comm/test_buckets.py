"""shardings.comm.buckets: bucketed reduction equals the per-leaf one, with one collective per bucket."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import shardings
from shardings import Mesh
from shardings.comm import accounting, buckets
from shardings.runtime.compat import LocalTensor


def _partial(shape, mesh, placements, seed):
    # A rank-dependent local value (what backward leaves on each rank before the reduction).
    ways = [1] * len(shape)
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            ways[p.dim] *= mesh.device_mesh.size(i)
    local_shape = [n // w for n, w in zip(shape, ways)]
    g = torch.Generator().manual_seed(seed)
    local = LocalTensor({r: torch.randn(local_shape, generator=g) for r in range(mesh.size)})
    return DTensor.from_local(local, mesh.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


@given(shapes=st.lists(st.sampled_from([(3,), (4, 2), (2, 6), (8,), (4, 4, 2)]), min_size=1, max_size=6),
       bucket_mb=st.sampled_from([None, 0, 0.00003, 0.0001, 25]), seed=st.integers(0, 3))
@settings(max_examples=10, deadline=None)
def test_bucketed_reduction_equals_per_leaf_redistribute_bitwise(shapes, bucket_mb, seed):
    mesh = Mesh(dp=2, tp=2)
    with shardings.simulate(4):
        grads, targets = [], []
        for i, shape in enumerate(shapes):
            src = (Partial(), Shard(0)) if shape[0] % 2 == 0 and i % 2 else (Partial(), Replicate())
            tgt = (Replicate(), Shard(0)) if shape[0] % 2 == 0 else (Replicate(), src[1])
            grads.append(_partial(shape, mesh, src, seed + i))
            targets.append(tgt)
        with accounting.comms() as c:
            got = buckets.reduce(grads, targets, bucket_mb)
        want = [g.redistribute(mesh.device_mesh, t) for g, t in zip(grads, targets)]
        plan = buckets.plan(grads, targets, bucket_mb)
        for a, b, t in zip(got, want, targets):
            assert tuple(a.placements) == tuple(t) and a.shape == b.shape
            assert all(torch.equal(x, y) for x, y in zip(shardings.per_rank(a.to_local()),
                                                         shardings.per_rank(b.to_local())))
    count = sum(r["count"] for r in c.rows() if r["kind"] == "all_reduce")
    assert count == (len(plan) if bucket_mb else len(grads))


def test_plan_packs_same_placements_up_to_the_cap_and_keeps_big_leaves_alone():
    mesh = Mesh(dp=2)
    with shardings.simulate(2):
        grads = [_partial(s, mesh, (Partial(),), 0) for s in [(10,), (10,), (10,), (100,)]]
        plan = buckets.plan(grads, [(Replicate(),)] * 4, bucket_mb=80e-6)  # 80 bytes: two 40-byte leaves
    assert [b.leaves for b in plan] == [(0, 1), (2,), (3,)]
    assert [b.nbytes for b in plan] == [80, 40, 400]


def test_reduce_scatters_and_already_reduced_grads_are_not_bucketed():
    mesh = Mesh(dp=2)
    with shardings.simulate(2):
        grads = [_partial((4,), mesh, (Partial(),), 0), _partial((4,), mesh, (Replicate(),), 1)]
        assert buckets.plan(grads, [(Shard(0),), (Replicate(),)]) == []


def test_negative_bucket_size_is_a_clear_error():
    with pytest.raises(ValueError, match=r"bucket_mb=-1.*Fix:"):
        buckets.plan([], [], bucket_mb=-1)


@pytest.mark.parametrize("bucket_mb", [None, 80e-6])
def test_reducing_in_a_dtype_casts_per_bucket_like_casting_every_gradient_first(bucket_mb):
    """``dtype=``: the pp path's bf16 gradients reduced in fp32, cast a bucket (or leaf) at a time: the same buckets
    (planned in the reduce dtype: 80 bytes hold two 10-element fp32 leaves, not four bf16 ones) and the same values as
    casting every gradient before the reduction."""
    mesh = Mesh(dp=2)
    with shardings.simulate(2):
        grads = [_partial(s, mesh, (Partial(),), i).to(torch.bfloat16) for i, s in enumerate([(10,), (10,), (10,)])]
        targets = [(Replicate(),)] * 3
        got = buckets.reduce(grads, targets, bucket_mb, torch.float32)
        cast = [g.to(torch.float32) for g in grads]
        want = buckets.reduce(cast, targets, bucket_mb)
        assert buckets.plan(grads, targets, bucket_mb, torch.float32) == buckets.plan(cast, targets, bucket_mb)
        assert [b.leaves for b in buckets.plan(grads, targets, 80e-6, torch.float32)] == [(0, 1), (2,)]
        for a, b in zip(got, want):
            assert a.dtype == torch.float32 and tuple(a.placements) == (Replicate(),)
            assert all(torch.equal(x, y) for x, y in zip(shardings.per_rank(a.to_local()),
                                                         shardings.per_rank(b.to_local())))
