"""shardings.runtime.fastlocal: simulate's cheaper per-rank loop computes what torch's loop computes (random draws
included: every rank draws the same numbers, as under torch's), and is torch's again outside simulate."""

import pytest
import torch

import shardings
from shardings import Mesh, P
from shardings.runtime import fastlocal
from shardings.runtime.compat import local_tensor_internals


@pytest.fixture(autouse=True)
def _sharing_on(monkeypatch):
    """Sharing is opt-in (fastlocal's docstring): these tests check it, so they turn it on."""
    monkeypatch.setenv("SHARDLAB_SIMULATE_SHARE", "1")


def _run(monkeypatch, fast):
    monkeypatch.setenv("SHARDLAB_SIMULATE_FAST", "1" if fast else "0")
    torch.manual_seed(0)
    with shardings.simulate(4):
        x = shardings.shard(torch.arange(8.0).reshape(4, 2), P("dp"), Mesh(dp=4)).to_local()  # differs per rank
        y = (x * 2 + torch.rand(2)).sum(0)  # a random op between rank-dependent ones
        drawn = torch.rand(3)
        cat = torch.cat([drawn, drawn + 1])  # a list argument
        return [shardings.per_rank(t) for t in (y, drawn, cat)]


def test_fast_loop_equals_torchs_loop(monkeypatch):
    fast, slow = _run(monkeypatch, True), _run(monkeypatch, False)
    for a, b in zip(fast, slow, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    drawn = fast[1]
    assert all(torch.equal(d, drawn[0]) for d in drawn)  # the same draw on every rank


def test_installed_only_inside_simulate():
    lt = local_tensor_internals()
    with shardings.simulate(2):
        assert lt.module._for_each_rank_run_func is fastlocal._run
    assert lt.module._for_each_rank_run_func is fastlocal._ORIGINAL
    assert lt.module._compute_local_tensor_meta is fastlocal._TORCH_META


def _sharing_program():
    """Replicated values (computed once), a shared buffer each rank then writes differently (copy-on-write), an
    all-gather whose equal results are merged, and ops on them: every rank's values, and which ranks share."""
    mesh = Mesh(dp=2, tp=2)
    x = shardings.shard(torch.arange(8.0).reshape(4, 2), P(("dp", "tp")), mesh).to_local()  # differs per rank
    w = torch.ones(2, 3) * 0.5  # a factory and an op on it: one value for every rank
    acc = torch.zeros(1, 3)
    acc.add_(x @ w)  # ranks differ: the shared zeros are copied first
    acc.mul_(2.0)  # each rank's own copy, written once
    full = shardings.reshard(shardings.shard(torch.arange(8.0), P("tp"), mesh), P()).to_local()  # all-gather
    y = (full * 3 - 1).exp()  # one value on every rank again
    half = shardings.reshard(shardings.shard(torch.arange(8.0), P(("dp", "tp")), mesh), P("dp")).to_local()
    z = half.sin()  # gathered over tp: the same within a dp group, not across them
    out = [acc, w, full, y, z]
    return [shardings.per_rank(t) for t in out], [len({id(v) for v in t._local_tensors.values()}) for t in out]


def test_equal_ranks_are_computed_once_and_give_torchs_values(monkeypatch):
    monkeypatch.setenv("SHARDLAB_SIMULATE_FAST", "1")
    with shardings.simulate(4):
        shared, distinct = _sharing_program()
    monkeypatch.setenv("SHARDLAB_SIMULATE_FAST", "0")
    with shardings.simulate(4):
        alone, alone_distinct = _sharing_program()
    for a, b in zip(shared, alone, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert alone_distinct == [4, 4, 4, 4, 4]  # torch's loop: one tensor per rank
    assert distinct == [4, 1, 1, 1, 2]  # the per-rank accumulator each rank's own, replicated values one tensor
    assert len({float(v.sum()) for v in shared[0]}) == 4  # ... and the accumulators really differ


def test_a_viewed_shared_tensor_is_written_once_when_every_rank_writes_the_same(monkeypatch):
    monkeypatch.setenv("SHARDLAB_SIMULATE_FAST", "1")
    with shardings.simulate(2):
        mesh = Mesh(dp=2)
        x = shardings.shard(torch.arange(2.0), P("dp"), mesh).to_local()  # differs per rank
        same = (x * 0).expand(2) + torch.arange(2.0)  # equal values, one tensor per rank
        assert len({id(v) for v in same._local_tensors.values()}) == 2
        buf = torch.zeros(2)  # one tensor for both ranks
        view = buf[1:]  # a view of it: a copy of buf would not be seen through it
        buf.add_(same)
        assert [v.tolist() for v in shardings.per_rank(view)] == [[1.0], [1.0]]
        assert [v.tolist() for v in shardings.per_rank(buf)] == [[0.0, 1.0], [0.0, 1.0]]


def test_a_write_of_different_values_to_a_viewed_shared_tensor_is_refused(monkeypatch):
    monkeypatch.setenv("SHARDLAB_SIMULATE_FAST", "1")
    with shardings.simulate(2):
        x = shardings.shard(torch.arange(2.0), P("dp"), Mesh(dp=2)).to_local()  # 0. on rank 0, 1. on rank 1
        buf = torch.zeros(2)  # one tensor for both ranks
        view = buf[:1]  # a view of it: a copy of buf would not be seen through it
        with pytest.raises(RuntimeError, match="SHARDLAB_SIMULATE_SHARE=0"):
            buf.add_(x.expand(2))
        assert all(torch.equal(v, torch.zeros(1)) for v in shardings.per_rank(view))  # nothing written


def test_memory_counted_under_simulate_is_the_same_with_sharing(monkeypatch):
    def peak():
        with shardings.simulate(4), shardings.peak_memory() as m:
            w = torch.ones(64, 64)
            (w @ w).sum()
        return m.peak

    monkeypatch.setenv("SHARDLAB_SIMULATE_SHARE", "0")
    alone = peak()
    monkeypatch.setenv("SHARDLAB_SIMULATE_SHARE", "1")
    assert peak() == alone
