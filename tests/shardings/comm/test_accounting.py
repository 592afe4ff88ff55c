"""comms() counts and bytes against hand-computed ring formulas; memory() of sharded/replicated/uneven trees."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

import core
from shardings import Mesh, P, reshard, shard, simulate
from shardings.comm.accounting import comms, memory, recorded_as

MESHES = {"dp2_tp2": Mesh(dp=2, tp=2), "dp4": Mesh(dp=4)}

# redistribute on one axis: (placement before, placement after, collective kind)
TRANSITIONS = {
    "P->R": (Partial(), Replicate(), "all_reduce"),
    "S->R": (Shard(0), Replicate(), "all_gather"),
    "P->S": (Partial(), Shard(0), "reduce_scatter"),
    "S0->S1": (Shard(0), Shard(1), "all_to_all"),
}


def _on_axis(mesh: Mesh, axis: str, placement):
    return [placement if name == axis else Replicate() for name in mesh.axis_names]


def _redistribute(local: torch.Tensor, mesh: Mesh, axis: str, before, after) -> None:
    dm = mesh.device_mesh
    DTensor.from_local(local, dm, _on_axis(mesh, axis, before)).redistribute(dm, _on_axis(mesh, axis, after))


# Hand-computed, local buffer 8x4 fp32 = 128 bytes. n=2: all-reduce 2·1/2·128, all-gather of
# B=2·128 sends 1/2·256, reduce-scatter 1/2·128. n=4: 2·3/4·128, 3/4·(4·128), 3/4·128.
@pytest.mark.parametrize(
    ("mesh", "transition", "count", "nbytes"),
    [
        ("dp2_tp2", "P->R", 1, 128),
        ("dp2_tp2", "S->R", 1, 128),
        ("dp2_tp2", "P->S", 1, 64),
        ("dp4", "P->R", 1, 192),
        ("dp4", "S->R", 1, 384),
        ("dp4", "P->S", 1, 96),
    ],
)
def test_redistribute_over_dp_hand_computed(mesh, transition, count, nbytes):
    mesh = MESHES[mesh]
    before, after, kind = TRANSITIONS[transition]
    with simulate(mesh.size):
        local = torch.ones(8, 4)
        with comms() as c:
            _redistribute(local, mesh, "dp", before, after)
    assert c.rows() == [{"kind": kind, "axis": "dp", "count": count, "bytes": nbytes}]
    assert c.total_bytes() == nbytes


@settings(max_examples=15)
@given(
    mesh_axis=st.sampled_from([("dp2_tp2", "dp"), ("dp2_tp2", "tp"), ("dp4", "dp")]),
    transition=st.sampled_from(sorted(TRANSITIONS)),
    rows=st.integers(1, 3),
    cols=st.integers(1, 2),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
)
def test_redistribute_bytes_follow_ring_formulas(mesh_axis, transition, rows, cols, dtype):
    mesh_name, axis = mesh_axis
    mesh = MESHES[mesh_name]
    n = mesh.shape[axis]
    before, after, kind = TRANSITIONS[transition]
    with simulate(mesh.size):
        local = torch.ones(rows * n, cols * n, dtype=dtype)
        b = local.numel() * local.element_size()
        full = {"all_reduce": b, "all_gather": n * b, "reduce_scatter": b, "all_to_all": b}[kind]
        factor = 2 if kind == "all_reduce" else 1
        with comms() as c:
            _redistribute(local, mesh, axis, before, after)
    assert c.rows() == [{"kind": kind, "axis": axis, "count": 1, "bytes": factor * (n - 1) * full // n}]


def test_two_axis_partial_reduces_once_per_axis():
    mesh = MESHES["dp2_tp2"]
    with simulate(4):
        dm = mesh.device_mesh
        with comms() as c:
            DTensor.from_local(torch.ones(4, 4), dm, [Partial(), Partial()]).redistribute(dm, [Replicate()] * 2)
    assert {(r["kind"], r["axis"], r["count"], r["bytes"]) for r in c.rows()} == {
        ("all_reduce", "dp", 1, 64),
        ("all_reduce", "tp", 1, 64),
    }
    assert c.total_bytes() == 128


def test_backward_collectives_are_counted():
    # ZeRO-3's pattern: all-gather the shard forward; its grad comes back Partial and is
    # reduce-scattered to the shard in backward.
    mesh = Mesh(dp=4)
    with simulate(4):
        dm = mesh.device_mesh
        w = DTensor.from_local(torch.ones(2, 4), dm, [Shard(0)])  # full 8x4 fp32 = 128 bytes

        def loss(w):
            full = w.redistribute(dm, [Replicate()]).to_local(grad_placements=[Partial()])
            return (full * full).sum()

        with comms() as forward_only:
            loss(w)
        with comms() as c:
            g = core.grad(loss)(w)
    assert g.placements == (Shard(0),)
    assert forward_only.rows() == [{"kind": "all_gather", "axis": "dp", "count": 1, "bytes": 96}]
    assert c.rows() == [
        {"kind": "all_gather", "axis": "dp", "count": 1, "bytes": 96},
        {"kind": "reduce_scatter", "axis": "dp", "count": 1, "bytes": 96},
    ]


def test_c10d_ops_distribute_and_recorded_as():
    mesh = MESHES["dp2_tp2"]
    with simulate(4):
        x = torch.ones(4, 4)  # 64 bytes
        dm = mesh.device_mesh  # built outside: building a DeviceMesh may itself broadcast
        with comms() as outer:
            dist.all_reduce(x)  # the world group: 2·3/4·64
            with comms() as inner:
                # distribute_tensor scatters from rank 0 over dp, then broadcasts over tp
                distribute_tensor(x, dm, [Shard(0), Replicate()])
            with recorded_as("ppermute", "tp", x):
                _redistribute(x, mesh, "tp", Partial(), Replicate())  # hidden: counted as one ppermute
    assert inner.rows() == [
        {"kind": "broadcast", "axis": "tp", "count": 1, "bytes": 32},
        {"kind": "scatter", "axis": "dp", "count": 1, "bytes": 32},
    ]
    assert outer.rows() == [
        {"kind": "all_reduce", "axis": "world", "count": 1, "bytes": 96},
        {"kind": "ppermute", "axis": "tp", "count": 1, "bytes": 64},
        *inner.rows(),
    ]
    table = outer.table()
    assert "ppermute" in table and "total" in table.splitlines()[-1] and "224 B" in table


def test_a_ppermute_is_counted_as_one_ppermute_of_its_buffer_without_recorded_as():
    # shardings.ppermute runs one all_to_all_single of one row: a compiled graph runs that op with no recorded_as
    # around it, so the op itself is what the accounting classifies (as eager's recorded_as would)
    from shardings import all_to_all, ppermute, shard_map

    mesh = Mesh(cp=4)
    ring = [(i, (i + 1) % 4) for i in range(4)]
    with simulate(4):
        x = shard(torch.arange(32.0).reshape(8, 4), P("cp"), mesh)  # 2x4 fp32 per rank: 32 bytes
        with comms() as c:
            shard_map(lambda b: ppermute(b, "cp", ring), mesh, P("cp"), P("cp"))(x)
            shard_map(lambda b: ppermute(b, "cp", [(0, 1)]), mesh, P("cp"), P("cp"))(x)  # a partial perm too
        with comms() as even:
            shard_map(lambda b: all_to_all(b, "cp", 1, 0, tiled=True), mesh, P("cp"), P("cp"))(x)  # of many rows
    assert c.rows() == [{"kind": "ppermute", "axis": "cp", "count": 2, "bytes": 64}]
    assert [r["kind"] for r in even.rows()] == ["all_to_all"]


def test_size_one_axis_moves_nothing():
    mesh = Mesh(dp=1, tp=4)
    assert mesh.device_axes == ("tp",)  # a size-1 axis has no device-mesh dim, hence no group
    with simulate(4):
        x = shard(torch.ones(4, 4), P("dp", "tp"), mesh)
        with comms() as c:
            reshard(x, P(None, "tp"))
    assert c.total_bytes() == 0 and c.rows() == []


def test_comms_outside_simulate_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"inside `with shardings.simulate"), comms():
        pass


def test_memory_plain_tree_counts_shared_storage_once():
    w = torch.zeros(4, 4)
    tree = {"w": w, "view": w[:2], "b": torch.zeros(3, dtype=torch.float64), "step": 7}
    assert memory(tree) == 64 + 24
    assert memory({"m": torch.empty(5, 5, device="meta")}) == 100


@pytest.mark.parametrize(
    ("placements", "rows", "expected"),
    [
        ([Replicate(), Replicate()], 8, 8 * 4 * 4),
        ([Shard(0), Replicate()], 8, 4 * 4 * 4),
        ([Shard(0), Shard(1)], 8, 4 * 2 * 4),
        ([Shard(0), Replicate()], 5, 3 * 4 * 4),  # uneven: rank 0 holds 3 rows, rank 1 only 2
        ([Shard(0), Shard(0)], 5, 2 * 4 * 4),  # 5 rows over 4 ranks: 2, 1, 1, 1
    ],
)
def test_memory_of_dtensors_is_the_max_over_ranks(placements, rows, expected):
    mesh = MESHES["dp2_tp2"]
    with simulate(4):
        x = distribute_tensor(torch.ones(rows, 4), mesh.device_mesh, placements)
        plain = torch.ones(2)  # held by every rank
        assert memory({"x": x, "again": x, "plain": plain}) == expected + 8
