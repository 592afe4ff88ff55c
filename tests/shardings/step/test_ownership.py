"""shardings.step.ownership: which leaves a process holds and updates (the mask every gradient path and the update
share), absent blocks, and the runtime's one answer to "simulated or real ranks?"."""

import torch
from torch.distributed.tensor import Shard

import core
import models
import shardings
from core import deferred
from shardings import Mesh, pipeline
from shardings.step import ownership
from shardings.step.ownership import Ownership, absent, is_absent

CFG = models.gpt.Config(vocab=64, dim=32, layers=4, heads=4, kv_heads=2, seq_len=8, mlp=64)


def test_the_mask_of_a_stage_and_what_it_implies():
    whole = Ownership()
    assert whole.whole and whole.held(3) == [0, 1, 2] and whole.shared() == [] and whole.counted() == []
    # leaves: embed (every rank), blocks 0-1 on rank 0, blocks 2-3 on rank 1, the head (every rank)
    owners = (None, 0, 0, 1, 1, None)
    on_1, on_0 = Ownership(owners, rank=1), Ownership(owners, rank=0)
    assert on_1.held(6) == [0, 3, 4, 5] and on_0.held(6) == [0, 1, 2, 5]
    assert on_1.shared() == [0, 5]  # their gradients are summed over pp
    assert on_0.counted() == [0, 1, 2, 5] and on_1.counted() == [3, 4]  # the shared ones once, on rank 0


def test_every_leaf_is_held_without_a_plan_or_on_simulated_ranks():
    with deferred.deferred():
        shapes = models.gpt.init(core.random.key(0), CFG)
    mesh = Mesh(pp=2)
    plan = pipeline.plan("pp", mesh, shapes)
    assert not shardings.simulated()
    assert ownership.ownership(None, shapes, mesh) == ownership.WHOLE
    with shardings.simulate(2):
        assert shardings.simulated()
        assert ownership.ownership(plan, shapes, mesh).whole  # every stage runs in this process


def test_an_absent_block_has_shape_and_layout_and_no_memory():
    with shardings.simulate(2):
        mesh = Mesh(dp=2)
        x = absent((4, 6), torch.float32, mesh, [Shard(0)])
        assert is_absent(x) and x.shape == (4, 6) and x.to_local().shape == (2, 6)
        assert all(t.device.type == "meta" for t in shardings.per_rank(x)) and not is_absent(torch.zeros(2))
