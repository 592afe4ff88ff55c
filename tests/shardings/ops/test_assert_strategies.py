"""shardings.ops.assert_strategies: ``aten._assert_async`` (what ``F.one_hot`` emits when traced) on DTensors checks
the value the DTensor stands for, with no output to place."""

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import shardings
from shardings import Mesh, rank_map


@pytest.mark.parametrize("placement", [Replicate(), Shard(0)])
def test_a_check_of_a_whole_or_split_dtensor_passes_where_every_element_holds_and_fails_where_one_does_not(placement):
    with shardings.simulate(2):
        mesh = Mesh(tp=2).device_mesh
        shape = (2,) if placement.is_shard() else (1,)
        torch._assert_async(distribute_tensor(torch.ones(shape, dtype=torch.bool), mesh, [placement]))
        torch.ops.aten._assert_async.msg(distribute_tensor(torch.ones(shape), mesh, [placement]), "in range")
        with pytest.raises(RuntimeError, match=r"zero|in range"):
            bad = torch.tensor([1.0, 0.0])[: shape[0]] if placement.is_shard() else torch.zeros(1)
            torch.ops.aten._assert_async.msg(distribute_tensor(bad, mesh, [placement]), "in range")


def test_a_partial_dtensor_is_checked_on_its_sum_not_on_each_ranks_share():
    with shardings.simulate(2):
        mesh = Mesh(tp=2).device_mesh
        shares = lambda a, b: DTensor.from_local(rank_map(lambda r: torch.tensor(a if r == 0 else b)), mesh,
                                                 [Partial()], run_check=False)
        torch._assert_async(shares(0.0, 1.0))  # rank 0's share is 0, the value (1) is not
        with pytest.raises(RuntimeError, match="zero"):
            torch._assert_async(shares(1.0, -1.0))  # every share is nonzero, the value (0) is not
