"""The DTensor path's ZeRO-3 backward (shardings.residency.gather_buckets, gather_params): each block bucket
re-gathered once, last block first, the next one already in flight; the root's kept."""

import functools

import pytest
import torch

import core
import models.gpt as gpt
import shardings
from core import tree
from shardings import Mesh
from shardings.comm import flat_comm
from shardings.residency import gather_buckets, gather_params

PREFETCH_CFG = gpt.Config(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, mlp=64, seq_len=8)


@pytest.mark.parametrize(("layout", "mesh", "local"), [
    ("zero3+tp", Mesh(dp=2, tp=2), True),  # model axes: the DTensor path whatever `local` says
    ("zero3", Mesh(dp=4), False),
], ids=["zero3+tp-dp2xtp2", "zero3-dp4-local=False"])
def test_dtensor_path_zero3_regathers_buckets_in_backward_prefetching_the_next(monkeypatch, layout, mesh, local):
    """The DTensor path's mirror of test_local_step's test: backward re-gathers each block bucket once, last block
    first, every one after the first already in flight when backward asks for it; the root's never."""
    created, launches, asked, plans = [], [], [], []  # buckets (forward order); (bucket, in backward); first asks
    init, launch = gather_buckets._Bucket.__init__, gather_buckets._Bucket.launch
    gathered, unit_buckets = gather_params.Regather.gathered, flat_comm.unit_buckets

    def recording_init(self, *args, **kw):
        init(self, *args, **kw)
        created.append(self)

    def recording_launch(self):
        launches.append((created.index(self), torch._C._current_autograd_node() is not None))
        return launch(self)

    def recording_gathered(self, k):
        bucket = self.buckets[k]  # registered by gather_buckets: launch is its _Bucket's bound method
        if bucket.hold and bucket.cached is None:  # backward's first ask: was its gather already launched?
            asked.append((created.index(bucket.launch.__self__), bucket.pending is not None))
        return gathered(self, k)

    def recording_unit_buckets(*args, **kw):
        plans.append(unit_buckets(*args, **kw))
        return plans[-1]

    monkeypatch.setattr(gather_buckets._Bucket, "__init__", recording_init)
    monkeypatch.setattr(gather_buckets._Bucket, "launch", recording_launch)
    monkeypatch.setattr(gather_params.Regather, "gathered", recording_gathered)
    monkeypatch.setattr(flat_comm, "unit_buckets", recording_unit_buckets)
    batch = gpt.example_batch(PREFETCH_CFG, 4)
    with shardings.simulate(mesh.size):
        params = shardings.init(gpt.init, core.random.key(0), PREFETCH_CFG, axes=gpt.axes(PREFETCH_CFG),
                                layout=layout, mesh=mesh)
        step = shardings.train_step(functools.partial(gpt.loss, cfg=PREFETCH_CFG), core.optim.sgd(0.1),
                                    layout=layout, mesh=mesh, bucket_mb=0.01, local=local)
        step.grads(params, batch)
        assert step.plan(params).local is None
    ((bucketed, kept),) = plans
    n, paths = len(created), [path for path, _ in tree.leaves_with_path(params)]
    assert n == len(bucketed) > PREFETCH_CFG.layers + 1  # several buckets per block
    forward = [k for k, backward in launches if not backward]
    backward = [k for k, backward in launches if backward]
    assert forward == list(range(n))  # in order, each once, as the loss first uses them (the next in flight)
    per_bucket = [{flat_comm.unit_of(paths[i]) for i in b} for b in bucketed]
    assert all(len(u) == 1 for u in per_bucket)  # a bucket never spans two blocks
    assert set(kept) == {k for k, u in enumerate(per_bucket) if u == {()}}  # the root's stay gathered
    assert sorted(backward) == sorted(set(range(n)) - set(kept))  # every block bucket re-gathered, once
    assert backward == sorted(backward, reverse=True)  # last block first
    assert [k for k, _ in asked] == backward
    assert not asked[0][1] and all(prefetched for _, prefetched in asked[1:])  # each next one was in flight
