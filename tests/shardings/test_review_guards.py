"""Places a review found unguarded: the DTensor path's ZeRO-3 backward re-gather order and prefetch, the
vocab-parallel cross-entropy on logits of magnitude 1e4 at tp 4 and 8, and the per-role bytes and per-step
collectives of ep layouts (from formulas)."""

import functools
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

import core
import models.gpt as gpt
import models.moe as moe
import shardings
from core import tree
from models.layers import cross_entropy
from shardings import Mesh, P, shard
from shardings.comm import flat_comm
from shardings.ops.vocab_parallel import nll
from shardings.residency import gather_buckets, gather_params
from shardings.testing import assert_close
from tests.shardings.test_coverage import DP2_EP2, GPT, MOE_2  # the cases' models and mesh

# -- the DTensor path's ZeRO-3 backward: re-gather order and prefetch --------------------------------------------------


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


# -- the vocab-parallel cross-entropy on large logits ------------------------------------------------------------------


def _large_logits(kind, vocab, tp):
    """``(4, 6, vocab)`` logits of magnitude 1e4 (exp() overflows without the max shift): spread (N(0, 1e4²): the
    softmax is ~one-hot) or shifted (1e4 + N(0, 3²): a full softmax on top of a large common offset); labels with
    about a quarter ignored; a cotangent per token."""
    gen = torch.Generator().manual_seed(tp + vocab)
    noise = torch.randn(4, 6, vocab, generator=gen)
    x = noise * 1e4 if kind == "spread" else 1e4 + 3 * noise
    labels = torch.randint(0, vocab, (4, 6), generator=gen)
    ignored = labels.masked_fill(torch.rand(4, 6, generator=gen) < 0.25, GPT.ignore_index)
    return x, labels, ignored, torch.randn(4, 6, generator=gen)


def _vocab_parallel(x, labels, ignored, cot, tp):
    """On tp simulated ranks, x's vocab dim sharded: per rank, per-token nll and its gradient, the mean loss
    (``cross_entropy`` with ignored labels) and its gradient, as full tensors."""
    with shardings.simulate(tp):
        mesh = Mesh(tp=tp)
        logits = shard(x, P(None, None, "tp"), mesh).requires_grad_()
        per_token = nll(logits, shard(labels, P(), mesh))
        (grad,) = torch.autograd.grad(per_token, logits, shard(cot, P(), mesh))
        logits = shard(x, P(None, None, "tp"), mesh).requires_grad_()
        mean = cross_entropy(logits, shard(ignored, P(), mesh), GPT.ignore_index)
        (mean_grad,) = torch.autograd.grad(mean, logits)
        return list(zip(*(shardings.per_rank(t.full_tensor()) for t in (per_token, grad, mean, mean_grad))))


def _values_and_grads(fn, x, labels, ignored, cot):
    ref = x.clone().requires_grad_()
    per_token = fn(ref, labels, None)
    (grad,) = torch.autograd.grad(per_token, ref, cot)
    ref = x.clone().requires_grad_()
    mean = fn(ref, ignored, GPT.ignore_index)
    (mean_grad,) = torch.autograd.grad(mean, ref)
    return per_token.detach(), grad, mean.detach(), mean_grad


def _ours(x, labels, ignore_index):  # shardlab's single-device loss: what the gpt reference runs
    return nll(x, labels) if ignore_index is None else cross_entropy(x, labels, ignore_index)


def _torch(x, labels, ignore_index):
    if ignore_index is None:
        return F.cross_entropy(x.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    return F.cross_entropy(x.flatten(0, 1), labels.flatten(), ignore_index=ignore_index)


# vocab 64: nll's block function on each rank's block; vocab 60 over tp 8: uneven blocks, the composite form
@pytest.mark.parametrize(("kind", "vocab", "tp"), list(itertools.product(["spread", "shifted"], [64, 60], [4, 8])))
def test_vocab_parallel_cross_entropy_on_logits_of_magnitude_1e4_equals_one_device_and_torch(kind, vocab, tp):
    x, labels, ignored, cot = _large_logits(kind, vocab, tp)
    references = {"one device": _values_and_grads(_ours, x, labels, ignored, cot),
                  "torch": _values_and_grads(_torch, x, labels, ignored, cot)}
    names = ("per-token loss", "its gradient", "mean loss", "its gradient")
    for rank, got in enumerate(_vocab_parallel(x, labels, ignored, cot, tp)):
        for reference, want in references.items():
            for name, g, w in zip(names, got, want):
                assert w.isfinite().all(), name
                # a loss subtracts logits of size |x| (the rule's magnitude); gradients take the plain rule
                magnitude = float(x.abs().max()) if "loss" in name else None
                assert_close(g, w, terms=vocab, magnitude=magnitude, msg=f"rank {rank} vs {reference}, {name}")


# -- ep layouts: persistent bytes per role and collectives per step, from formulas -------------------------------------


def _moe_sizes(cfg):
    """Elements of the dense weights and of the expert weights (leaves with an ``expert`` dim), the number of dense
    leaves and of all leaves, the MoE layers, and the root's elements (outside the blocks)."""
    params = moe.init(core.random.key(0), cfg)
    sizes = [x.numel() for x in tree.leaves(params)]
    is_expert = [("expert" in names) for names in tree.leaves(moe.axes(cfg), is_leaf=lambda a: isinstance(a, tuple))]
    expert = sum(n for n, e in zip(sizes, is_expert) if e)
    root = sum(x.numel() for k, x in params.items() if k != "blocks")
    return (sum(sizes) - expert, expert, is_expert.count(False), len(sizes), sum(map(cfg.is_moe, range(cfg.layers))),
            root)


def _ring(kind, n, nbytes):
    return nbytes * 2 * (n - 1) // n if kind == "all_reduce" else nbytes * (n - 1) // n


def _ep_memory(divisors):
    """Persistent bytes per rank per role: dense weights split by the data presets, expert weights by ep too;
    AdamW's two moments and its int32 step count."""
    dense, expert, *_ = _moe_sizes(MOE_2)
    out = {role: 4 * (dense // d + expert // e) * (2 if role == "opt_state" else 1) for role, (d, e) in
           zip(("params", "grads", "opt_state"), divisors)}
    out["opt_state"] += 4
    return {**out, "compute": 0, "host": 0}  # fp32: no compute-dtype copy; nothing offloaded


def _ep_comm(layout, mesh, rows):
    """Kinds, axes, counts and bytes of one step, from the model's sizes (DESIGN §4's ep row, §6's formulas)."""
    dense, expert, n_dense, n_leaves, moe_layers, root = _moe_sizes(MOE_2)
    ep, dp = mesh["ep"], mesh.get("dp", 1)
    local = 4 * (dense + expert // ep)  # a rank's share of the weights: experts split over ep
    # the MoE layers' all-to-alls: per layer 2 forward + 2 backward, each (ep-1)/ep of one rank's
    # (experts, rows · capacity, dim) fp32 buffer
    rank_rows = rows // math.prod(n for a, n in mesh.items() if a in ("dp", "fsdp", "ep"))
    buffer = 4 * MOE_2.experts * rank_rows * moe.capacity(MOE_2, MOE_2.seq_len) * MOE_2.dim
    table = {("all_to_all", "ep"): (4 * moe_layers, 4 * moe_layers * _ring("all_to_all", ep, buffer))}
    if layout in ("ep", "dp+ep"):
        # DDP over (dp, ep) for the dense weights (one bucket: all-reduce over each axis), over dp for experts
        table[("all_reduce", "ep")] = (1, _ring("all_reduce", ep, 4 * dense))
        if dp > 1:
            table[("all_reduce", "dp")] = (2, _ring("all_reduce", dp, local))
    elif layout in ("zero1+ep", "zero2+ep"):
        # per leaf (the DTensor path): reduce-scatter over dp, then the dense shard all-reduced over ep;
        # the updated shards all-gathered back over dp
        table[("reduce_scatter", "dp")] = (n_leaves, _ring("reduce_scatter", dp, local))
        table[("all_reduce", "ep")] = (n_dense, _ring("all_reduce", ep, 4 * dense // dp))
        table[("all_gather", "dp")] = (n_leaves, _ring("all_gather", dp, local))
    else:  # zero3+ep, hsdp+ep: ZeRO-3 over the shard axis
        # one bucket per block and one for the root: gathered, blocks again in backward, reduce-scattered;
        # before that each dense gradient is all-reduced over ep whole, one collective per leaf (and hsdp's
        # replica all-reduce over dp moves each leaf's whole gradient too: DTensor reduces Partial over the
        # mesh dims in order, dp before fsdp; reducing the fsdp shard would move half)
        units, axis = MOE_2.layers + 1, "fsdp" if "fsdp" in mesh else "dp"
        table[("all_gather", axis)] = (2 * units - 1, _ring("all_gather", mesh[axis], 2 * local - 4 * root))
        table[("reduce_scatter", axis)] = (units, _ring("reduce_scatter", mesh[axis], local))
        table[("all_reduce", "ep")] = (n_dense, _ring("all_reduce", ep, 4 * dense))
        if axis == "fsdp":
            table[("all_reduce", "dp")] = (n_leaves, _ring("all_reduce", dp, local))
    return table


# (dense divisor, expert divisor) of params, grads, opt_state per rank: the data presets split dense weights,
# ep splits expert weights in every role
EP_BYTES = {
    "ep ep2": ("ep", {"ep": 2}, [(1, 2), (1, 2), (1, 2)]),
    "ep ep4": ("ep", {"ep": 4}, [(1, 4), (1, 4), (1, 4)]),
    "dp+ep dp2×ep2": ("dp+ep", DP2_EP2, [(1, 2), (1, 2), (1, 2)]),
    "zero1+ep dp2×ep2": ("zero1+ep", DP2_EP2, [(1, 2), (1, 2), (2, 4)]),
    "zero2+ep dp2×ep2": ("zero2+ep", DP2_EP2, [(1, 2), (2, 4), (2, 4)]),
    "zero3+ep dp2×ep2": ("zero3+ep", DP2_EP2, [(2, 4), (2, 4), (2, 4)]),
    "hsdp+ep dp2×fsdp2×ep2": ("hsdp+ep", {"dp": 2, "fsdp": 2, "ep": 2}, [(2, 4), (2, 4), (2, 4)]),
}


@pytest.mark.parametrize(("layout", "sizes", "divisors"), list(EP_BYTES.values()), ids=list(EP_BYTES))
def test_ep_layouts_persistent_bytes_per_role_and_collectives_per_step(layout, sizes, divisors):
    # torch caches DTensor's sharding propagation by spec equality, so after an earlier simulate() in this process
    # some gradients carry that session's (equal, torn-down) DeviceMesh and buckets.plan, which keys buckets by the
    # DeviceMesh object, reduces them in two collectives instead of one: start from empty caches
    _clear_sharding_prop_cache()
    rows = max(4, math.prod(n for a, n in sizes.items() if a != "tp"))
    mesh, batch = Mesh(sizes), moe.example_batch(MOE_2, rows)  # built outside simulate(): one global batch
    with shardings.simulate(mesh.size):
        params = shardings.init(moe.init, core.random.key(0), MOE_2, axes=moe.axes(MOE_2), layout=layout, mesh=mesh)
        step = shardings.train_step(functools.partial(moe.loss, cfg=MOE_2), core.optim.adamw(1e-3), layout=layout,
                                    mesh=mesh, axes=moe.axes(MOE_2))
        _, _, metrics = step(params, step.init(params), batch)
    assert metrics["memory"] == _ep_memory(divisors)
    assert {(r["kind"], r["axis"]): (r["count"], r["bytes"]) for r in metrics["comm"]} == _ep_comm(layout, sizes, rows)
