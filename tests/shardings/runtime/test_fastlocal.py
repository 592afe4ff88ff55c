"""shardings.runtime.fastlocal: simulate's cheaper per-rank loop computes what torch's loop computes (random draws
included: every rank draws the same numbers, as under torch's), and is torch's again outside simulate."""

import torch

import shardings
from shardings import Mesh, P
from shardings.runtime import fastlocal
from shardings.runtime.compat import local_tensor_internals


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
