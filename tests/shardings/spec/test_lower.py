"""Lowering P <-> DTensor placements, and the block geometry every rank owns."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from shardings import Mesh, P, ShardingError, per_rank, shard, simulate
from shardings.spec.lower import from_placements, local_block, mesh_of, rank_coords, to_placements, without_size1_axes
from shardings.testing import meshes, specs

shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)


def test_to_placements_examples():
    mesh = Mesh(dp=2, tp=2)
    assert to_placements(None, mesh) == (Replicate(), Replicate())
    assert to_placements(P(None, "tp"), mesh) == (Replicate(), Shard(1))
    assert to_placements(P(("dp", "tp")), mesh) == (Shard(0), Shard(0))
    assert to_placements(P(("tp", "dp")), mesh, (8,)) == (_StridedShard(0, split_factor=2), Shard(0))
    assert to_placements(P("tp", "dp"), mesh, 2) == (Shard(1), Shard(0))  # ndim only


def test_to_placements_three_axes_split_factors():
    # DTensor's rule: an axis's split factor is the product of the axes before it in the tuple
    # that come after it in the mesh.
    mesh = Mesh(a=4, b=3, c=2)
    assert to_placements(P(("c", "a", "b")), mesh, (24,)) == (
        _StridedShard(0, split_factor=2),
        _StridedShard(0, split_factor=2),
        Shard(0),
    )
    assert to_placements(P(("b", "c", "a")), mesh, (24,)) == (
        _StridedShard(0, split_factor=6),
        Shard(0),
        Shard(0),
    )


def test_out_of_order_tuple_on_uneven_dim_is_rejected():
    mesh = Mesh(dp=2, tp=3)
    with pytest.raises(ShardingError) as e:
        to_placements(P(None, ("tp", "dp")), mesh, (4, 7), path=(("w"),))
    msg = str(e.value)
    for part in ["P(None, ('tp', 'dp'))", "Mesh(dp=2, tp=3)", "dim 1 (size 7)", "divisible by 6", "Fix: "]:
        assert part in msg
    # The same tuple in mesh order is fine at any size (uneven shards, torch.chunk semantics).
    assert to_placements(P(None, ("dp", "tp")), mesh, (4, 7)) == (Shard(1), Shard(1))


def test_size1_axis_out_of_order_needs_no_stride():
    mesh = Mesh(dp=3, tp=1)
    assert mesh.device_axes == ("dp",)  # size-1 axes get no device-mesh dim
    assert to_placements(P(("tp", "dp")), mesh, (7,)) == (Shard(0),)


def test_all_size1_mesh_keeps_one_device_axis():
    mesh = Mesh(dp=1, tp=1)
    assert mesh.device_axes == ("dp",)
    assert to_placements(P("tp", "dp"), mesh, (2, 2)) == (Replicate(),)


def test_to_placements_rejects_bad_specs():
    mesh = Mesh(dp=2)
    with pytest.raises(ShardingError, match=r"unknown mesh axis 'tp'.*Fix: "):
        to_placements(P("tp"), mesh)
    with pytest.raises(ShardingError, match=r"2 entries but the tensor has only 1 dim"):
        to_placements(P(None, "dp"), mesh, 1)
    with pytest.raises(TypeError, match=r"expected a P\(...\) spec"):
        to_placements(("dp",), mesh)


@given(mesh=meshes(), shape=shapes, data=st.data())
@settings(max_examples=200)
def test_from_placements_inverts_to_placements(mesh, shape, data):
    spec = data.draw(specs(shape, mesh))
    placements = to_placements(spec, mesh, shape)
    back, partial = from_placements(placements, mesh)
    assert partial == {}
    assert to_placements(back, mesh, shape) == placements
    assert back == without_size1_axes(spec, mesh)  # size-1 axes have no device-mesh dim


def test_from_placements_partial_and_order():
    mesh = Mesh(tp=2, dp=2)
    assert from_placements((Shard(1), Partial()), mesh) == (P(None, "tp"), {"dp": "sum"})
    assert from_placements((Partial("avg"), Partial("avg")), mesh) == (P(), {"tp": "avg", "dp": "avg"})
    assert from_placements((_StridedShard(0, split_factor=2), Shard(0)), mesh) == (P(("dp", "tp")), {})


def test_from_placements_rejects_undecodable_stride():
    with pytest.raises(ShardingError, match="no P can express"):
        from_placements((_StridedShard(0, split_factor=3), Shard(0)), Mesh(a=2, b=2))


def test_rank_coords_row_major():
    assert rank_coords(Mesh(dp=2, tp=3))[4] == {"dp": 1, "tp": 1}
    assert rank_coords(Mesh(a=1)) == [{"a": 0}]


def test_local_block_examples():
    mesh = Mesh(dp=2, tp=2)
    assert local_block((5, 4), P("dp", "tp"), mesh, {"dp": 1, "tp": 0}) == (slice(3, 5), slice(0, 2))
    # (tp, dp): tp is major, so rank dp=1, tp=0 holds the second quarter.
    assert local_block((8,), P(("tp", "dp")), mesh, {"dp": 1, "tp": 0}) == (slice(2, 4),)
    # Nested torch.chunk: 5 -> [3, 2] over dp, then [2, 1] and [1, 1] over tp.
    blocks = [local_block((5,), P(("dp", "tp")), mesh, c)[0] for c in rank_coords(mesh)]
    assert blocks == [slice(0, 2), slice(2, 3), slice(3, 4), slice(4, 5)]
    # Past the last chunk: empty.
    assert local_block((1,), P("dp"), mesh, {"dp": 1, "tp": 0}) == (slice(1, 1),)


@given(mesh=meshes(), shape=shapes, data=st.data())
@settings(max_examples=200)
def test_local_blocks_cover_each_element_once_per_replica(mesh, shape, data):
    spec = data.draw(specs(shape, mesh))
    count = torch.zeros(shape, dtype=torch.int64)
    for coords in rank_coords(mesh):
        count[local_block(shape, spec, mesh, coords)] += 1
    assert torch.all(count == mesh.size // mesh.axis_size(spec.axes))


@given(mesh=meshes(), shape=shapes, data=st.data())
@settings(max_examples=40)
def test_local_block_is_what_dtensor_puts_on_each_rank(mesh, shape, data):
    spec = data.draw(specs(shape, mesh))
    x = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    with simulate(mesh.size):
        shards = per_rank(shard(x, spec, mesh))
    for coords, local in zip(rank_coords(mesh), shards):
        assert torch.equal(local, x[local_block(shape, spec, mesh, coords)])


def test_mesh_of():
    with simulate(4):
        x = shard(torch.ones(4), P("tp"), Mesh(tp=2, dp=2))
        assert mesh_of(x) == Mesh(tp=2, dp=2)


@pytest.mark.parametrize(
    ("sizes", "spec", "shape"),
    [
        ({"a": 2, "b": 3}, P(("b", "a")), (12,)),
        ({"a": 2, "b": 3}, P(None, ("b", "a")), (1, 6)),
        ({"a": 2, "b": 2, "c": 2}, P(("c", "b", "a")), (8,)),
        ({"a": 2, "b": 2, "c": 2}, P(("b", "c", "a"), None), (16, 3)),
        ({"a": 2, "b": 2, "c": 2}, P(("c", "a"), "b"), (4, 5)),
        ({"a": 2, "b": 1, "c": 3}, P(("c", "b", "a")), (6,)),
    ],
)
def test_strided_blocks_match_dtensor(sizes, spec, shape):
    mesh = Mesh(sizes)
    assert any(isinstance(p, _StridedShard) for p in to_placements(spec, mesh, shape))
    x = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    with simulate(mesh.size):
        shards = per_rank(shard(x, spec, mesh))
    for coords, local in zip(rank_coords(mesh), shards):
        assert torch.equal(local, x[local_block(shape, spec, mesh, coords)])


def test_rank_coords_on_a_stage_mesh_are_the_parents_less_the_sliced_axis():
    stage = Mesh(dp=2, pp=2, tp=2).without("pp")  # global rank = dp·4 + pp·2 + tp
    assert rank_coords(stage)[6] == {"dp": 1, "tp": 0}
    assert len(rank_coords(stage)) == 8
    assert rank_coords(Mesh(pp=2).without("pp"))[1] == {"dp": 0}
