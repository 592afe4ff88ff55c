"""shardings.step.local_step: data-parallel layouts on local tensors equal the DTensor path and one device."""

import functools
import weakref

import pytest
import torch
from torch.utils._pytree import MappingKey, SequenceKey

import core
import models.gpt as gpt
import shardings
from core import tree
from shardings import Mesh
from shardings.comm import flat_comm
from shardings.residency.lazy_params import Gathers, Lazy
from shardings.step import local_step
from shardings.testing import check_equivalence

CFG = gpt.Config(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, mlp=64, seq_len=8)
BATCH = gpt.example_batch(CFG, 4)  # built outside simulate(), where a random op draws one stream per rank
SMALL_BUCKETS = 0.01  # 10 kB: several buckets for CFG, so bucket boundaries, overlap and prefetch all run


def _step(layout, mesh, cfg=CFG, **kw):
    params = shardings.init(gpt.init, core.random.key(0), cfg, axes=gpt.axes(cfg), layout=layout, mesh=mesh)
    step = shardings.train_step(functools.partial(gpt.loss, cfg=cfg), core.optim.adamw(1e-2), layout=layout,
                                mesh=mesh, **kw)
    return params, step


@pytest.mark.parametrize(("layout", "mesh"), [
    ("dp", Mesh(dp=4)), ("zero1", Mesh(dp=4)), ("zero2", Mesh(dp=2)), ("zero3", Mesh(dp=4)),
    ("hsdp", Mesh(dp=2, fsdp=2)), ("zero3", Mesh(dp=2, tp=2)),  # an idle tp axis: ranks along it agree
])
def test_local_path_matches_the_single_device_reference_with_accumulation_clipping_and_small_buckets(layout, mesh):
    batch = gpt.example_batch(CFG, 8, with_ignored=True)  # uneven token counts per rank and microbatch
    with shardings.simulate(mesh.size):
        params, step = _step(layout, mesh, bucket_mb=SMALL_BUCKETS)
        lp = step.plan(params).local
    assert lp is not None and len(lp.gathers if layout in ("zero3", "hsdp") else lp.reduces) > 1
    report = check_equivalence(gpt.init, gpt.loss, gpt.axes, CFG, batch, layouts=[layout], mesh=mesh, steps=2,
                               accum_steps=2, clip_norm=0.5)
    assert report.ok


@pytest.mark.parametrize(("layout", "mesh"), [
    ("tp", Mesh(tp=2)), ("dp+tp", Mesh(dp=2, tp=2)), ("zero3+tp", Mesh(dp=2, tp=2)), ("dp+cp", Mesh(dp=2, cp=2)),
    ("zero3+tp+sp", Mesh(dp=2, tp=2)),
])
def test_layouts_with_model_axes_take_the_dtensor_path(layout, mesh):
    with shardings.simulate(mesh.size):
        params, step = _step(layout, mesh)
        assert step.plan(params).local is None


def test_uneven_shards_and_local_false_take_the_dtensor_path():
    with shardings.simulate(3):  # dim 32 does not split evenly over 3 ranks
        params, step = _step("zero3", Mesh(dp=3))
        assert step.plan(params).local is None
    with shardings.simulate(4):
        params, step = _step("dp", Mesh(dp=4), local=False)
        assert step.plan(params).local is None


@pytest.mark.parametrize("layout", ["dp", "zero2", "zero3"])
def test_only_a_donating_step_writes_into_the_params_it_was_given(layout):
    batch = gpt.example_batch(CFG, 4)
    with shardings.simulate(2):
        results = {}
        for donate in (False, True):
            params, step = _step(layout, Mesh(dp=2), donate=donate)
            before = tree.map(lambda p: p.full_tensor().clone(), params)
            new, _, _ = step(params, step.init(params), batch)
            results[donate] = tree.map(lambda p: p.full_tensor(), new)
            old_now = tree.map(lambda p: p.full_tensor(), params)
            written = [not torch.equal(a, b) for a, b in zip(tree.leaves(old_now), tree.leaves(before))]
            if not donate:
                assert not any(written)  # a pure step: the caller's params are untouched
            elif layout != "zero2":  # (zero2 updates a chunk of each replicated param, then gathers anew)
                assert all(written)  # fused AdamW wrote every shard in place
    for a, b in zip(tree.leaves(results[False]), tree.leaves(results[True])):
        assert torch.equal(a, b)  # the same kernel on copies: bitwise the same step


def test_dp_buckets_are_reduced_during_backward_in_backward_order(monkeypatch):
    launched = []
    launch = flat_comm.launch_reduce
    monkeypatch.setattr(flat_comm, "launch_reduce",
                        lambda comm, g, t: launched.append(torch._C._current_autograd_node() is not None)
                        or launch(comm, g, t))
    with shardings.simulate(4):
        params, step = _step("dp", Mesh(dp=4), bucket_mb=SMALL_BUCKETS)
        step.grads(params, BATCH)
        lp = step.plan(params).local
    # Every bucket's all-reduce starts inside backward (as soon as its last gradient exists): overlap.
    assert len(launched) == len(lp.reduces) > 1 and all(launched)
    assert [i for b in lp.reduces for i in b] == list(range(len(tree.leaves(params))))[::-1]


def test_zero3_regathers_buckets_in_backward_prefetching_the_next(monkeypatch):
    gathered = []
    launch = local_step._Gathered._launch
    monkeypatch.setattr(local_step._Gathered, "_launch", lambda self, k: gathered.append(k) or launch(self, k))
    with shardings.simulate(4):
        params, step = _step("zero3", Mesh(dp=4), bucket_mb=SMALL_BUCKETS)
        step.grads(params, BATCH)
        lp = step.plan(params).local
        n, paths = len(lp.gathers), [path for path, _ in tree.leaves_with_path(params)]
    forward, backward = gathered[:n], gathered[n:]
    assert forward == list(range(n))  # all launched before the loss runs
    # Buckets never span two blocks (FSDP's units). Backward re-gathers each block bucket autograd
    # saved from, once, last block first (the next one is launched while the current bucket's
    # backward runs). The root unit's buckets (embedding, final norm, unembedding) stay gathered
    # from forward, as FSDP2's root module's do: never re-gathered.
    units = {flat_comm.unit_of(path) for path, _ in tree.leaves_with_path(params)}
    per_bucket = [{flat_comm.unit_of(paths[i]) for i in b} for b in lp.gathers]
    assert all(len(u) == 1 for u in per_bucket) and {u for (u,) in per_bucket} == units
    assert set(lp.kept) == {k for k, u in enumerate(per_bucket) if u == {()}}
    assert len(backward) == len(set(backward)) > 1 and not set(backward) & set(lp.kept)
    assert backward == sorted(backward, reverse=True)


def test_unused_parameters_get_zero_gradients():
    def loss_without_final_norm(params, batch, cfg):  # final_norm unused: its gradient is zero
        params = dict(params, final_norm=params["final_norm"].detach() * 0 + 1)
        return gpt.loss(params, batch, cfg)

    with shardings.simulate(4):
        mesh = Mesh(dp=4)
        params = shardings.init(gpt.init, core.random.key(0), CFG, axes=gpt.axes(CFG), layout="dp", mesh=mesh)
        step = shardings.train_step(functools.partial(loss_without_final_norm, cfg=CFG), core.optim.sgd(0.1),
                                    layout="dp", mesh=mesh, bucket_mb=SMALL_BUCKETS)
        _, grads, _ = step.grads(params, BATCH)
        assert step.plan(params).local is not None
        assert float(shardings.unwrap(grads["final_norm"].full_tensor().abs().sum())) == 0.0
        assert float(shardings.unwrap(grads["embed"].full_tensor().abs().sum())) > 0.0


def test_count_comms_false_leaves_the_comm_metrics_empty():
    with shardings.simulate(4):
        params, step = _step("dp", Mesh(dp=4), count_comms=False)
        _, _, metrics = step(params, step.init(params), BATCH)
    assert metrics["comm"] is None and metrics["comm_bytes"] is None and metrics["loss"] > 0



@pytest.mark.parametrize(("layout", "mesh"), [("dp", Mesh(dp=4)), ("zero3", Mesh(dp=4)), ("hsdp", Mesh(dp=2, fsdp=2))])
def test_step_metrics_agree_with_the_dtensor_path(layout, mesh):
    batch = gpt.example_batch(CFG, 4, with_ignored=True)
    got = {}
    for local in (True, False):
        with shardings.simulate(mesh.size):
            params, step = _step(layout, mesh, local=local)
            _, _, got[local] = step(params, step.init(params), batch)
    for key in ("loss", "grad_norm"):
        assert got[True][key] == pytest.approx(got[False][key], rel=1e-5), key
    assert got[True]["tokens"] == got[False]["tokens"] and got[True]["memory"] == got[False]["memory"]


def test_only_a_root_beside_blocks_stays_gathered():
    block = (MappingKey("blocks"), SequenceKey(0))
    leaves = [torch.ones(2), torch.ones(2), torch.ones(2)]
    key = lambda i: ()
    assert flat_comm.unit_buckets([0, 1, 2], leaves, key, 25, [(), block, ()]) == (((0, 2), (1,)), (0,))
    # no blocks (an MLP's dict of layers): one unit, all re-gathered
    assert flat_comm.unit_buckets([0, 1], leaves, key, 25, [(), ()]) == (((0, 1),), ())


def test_zero3_gathers_each_block_when_the_loss_first_uses_it_and_frees_it_after():
    """FSDP2's forward: the loss sees placeholders; a block is gathered on first use, dropped when the next starts."""
    seen = []  # per block: (placeholder?, earlier blocks' gathered weights still alive)

    def loss_fn(params, batch):
        x, earlier = batch["x"], []
        for w in params["blocks"]:
            lazy = isinstance(w, Lazy) and w.shape == (4, 4) and w.ndim == 2  # metadata: no gather
            full = w.owner.materialize(w.bucket)[w.pos]  # what the first op on it gets
            x = torch.tanh(x @ w)
            seen.append((lazy, sum(r() is not None for r in earlier)))
            earlier.append(weakref.ref(full))
            del full
        return x.square().mean()

    params = {"blocks": [torch.randn(4, 4) for _ in range(3)]}
    batch = {"x": torch.randn(4, 4)}
    mesh = Mesh(dp=2)
    with shardings.simulate(2):
        sharded = shardings.shard(params, {"blocks": [shardings.P("dp")] * 3}, mesh)
        step = shardings.train_step(loss_fn, core.optim.sgd(0.1), layout="zero3", mesh=mesh,
                                    axes={"blocks": [("embed", None)] * 3}, token_count=lambda b: b["x"].shape[0])
        step(sharded, step.init(sharded), batch)
    assert seen == [(True, 0), (True, 0), (True, 0)]


@pytest.mark.parametrize("local", [True, False])
def test_zero3_awaits_a_prefetch_the_loss_never_used_when_the_step_ends(monkeypatch, local):
    closed = []  # per close: the gathers still pending
    close = Gathers.close
    monkeypatch.setattr(Gathers, "close", lambda self: (closed.append(sorted(self.pending)), close(self))[1])

    def loss_fn(params, batch):  # the last block is never used: its prefetch is left pending
        return torch.tanh(torch.tanh(batch["x"] @ params["blocks"][0]) @ params["blocks"][1]).square().mean()

    params = {"blocks": [torch.randn(4, 4) for _ in range(3)]}
    mesh = Mesh(dp=2)
    with shardings.simulate(2):
        sharded = shardings.shard(params, {"blocks": [shardings.P("dp")] * 3}, mesh)
        step = shardings.train_step(loss_fn, core.optim.sgd(0.1), layout="zero3", mesh=mesh, local=local,
                                    axes={"blocks": [("embed", None)] * 3}, token_count=lambda b: b["x"].shape[0])
        _, grads, _ = step.grads(sharded, {"x": torch.randn(4, 4)})
        unused = float(shardings.unwrap(grads["blocks"][2].full_tensor().abs().sum()))
    # awaited once, at the end of forward; the close after backward finds nothing pending
    assert closed[0] == [2] and not any(closed[1:]) and unused == 0.0


@pytest.mark.parametrize(("layout", "mesh"), [("zero3", Mesh(dp=2)), ("zero3+tp+sp", Mesh(dp=2, tp=2))])
def test_zero3_gathered_on_first_use_under_remat_matches_the_reference(layout, mesh):
    # remat recomputes a block in backward, after its gathered weights were dropped: they are gathered again
    cfg = gpt.Config(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, mlp=64, seq_len=8, remat=True)
    report = check_equivalence(gpt.init, gpt.loss, gpt.axes, cfg, gpt.example_batch(cfg, 4), layouts=[layout],
                               mesh=mesh, steps=2)
    assert report.ok
