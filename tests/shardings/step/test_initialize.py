"""shardings.init: bitwise equal to the single-device init, stored as the layout says, never materialized whole."""

import contextlib
import math
from typing import NamedTuple
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import core
import models
import shardings
from core import deferred, tree
from shardings import Mesh, ShardingError, gather, per_rank, simulate, spec_of
from shardings.runtime.compat import LocalTensor
from shardings.spec import layouts
from shardings.spec.lower import local_block, rank_coords, to_placements
from shardings.step.initialize import init, param_specs
from shardings.testing import assert_close

CONFIGS = {
    # Sizes that split unevenly (embed 16 over 3 or 6 ranks, vocab 13 over 2) and even empty shards.
    "mlp": models.mlp.Config(vocab=13, dim=6, mlp=10, layers=2, seq_len=4),
    "gpt": models.gpt.Config(vocab=13, dim=16, layers=1, heads=4, kv_heads=2, mlp=10, seq_len=4),
}


class Call(NamedTuple):
    shape: tuple[int, ...]  # the parameter's full shape
    block: tuple[int, ...]  # the block one rank asked for
    largest: int  # the most elements any single op produced while computing it


class _Largest(TorchDispatchMode):
    """Records the largest op output. A LocalTensor counts all its ranks' values: work done in one process."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree.leaves(out):
            if isinstance(t, LocalTensor):
                self.largest = max(self.largest, sum(v.numel() for v in t._local_tensors.values()))
            elif isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@contextlib.contextmanager
def recording_blocks():
    """Every ``Deferred.block`` evaluation, with the largest tensor computed for it."""
    calls, block = [], deferred.Deferred.block

    def recorded(self, index):
        with _Largest() as largest:
            out = block(self, index)
        calls.append(Call(tuple(self.shape), tuple(out.shape), largest.largest))
        return out

    with mock.patch.object(deferred.Deferred, "block", recorded):
        yield calls


@st.composite
def cases(draw):
    """A model, a mesh of 1-8 ranks over dp/fsdp/tp (size-1 axes included), and a layout valid on it."""
    model = draw(st.sampled_from(sorted(CONFIGS)))
    sizes = {"dp": draw(st.integers(1, 3)), "fsdp": draw(st.integers(1, 2)), "tp": draw(st.integers(1, 2))}
    names = draw(st.lists(st.sampled_from(sorted(sizes)), min_size=1, max_size=3, unique=True))
    mesh = Mesh({n: sizes[n] for n in ("dp", "fsdp", "tp") if n in names})
    data = [p for p in ("dp", "zero1", "zero2", "zero3", "hsdp") if p != "hsdp" or "fsdp" in names]
    data = data if {"dp", "fsdp"} & set(names) else []
    model_parallel = [mp for mp in [(), ("tp",), ("tp", "sp")] if "tp" in names or not mp]
    model_parallel = [mp for mp in model_parallel if mp or data]  # something to compose
    mp = draw(st.sampled_from(model_parallel))
    data_preset = draw(st.sampled_from(data + ([None] if mp else [])))
    return model, mesh, "+".join(p for p in (data_preset, *mp) if p)


def _check_sharded_init(model, mesh, layout):
    module, cfg = getattr(models, model), CONFIGS[model]
    ref = module.init(core.random.key(0), cfg)
    axes = module.axes(cfg)
    with simulate(mesh.size), recording_blocks() as calls:
        params = init(module.init, core.random.key(0), cfg, axes=axes, layout=layout, mesh=mesh)
        specs = tree.leaves(param_specs(axes, ref, layout, mesh))
        placed = [(spec_of(p), p.placements, per_rank(p)) for p in tree.leaves(params)]
        full = [per_rank(x) for x in tree.leaves(gather(params))]
    coords = rank_coords(mesh)
    ref_leaves = tree.leaves(ref)
    # each distinct block of each recipe drawn once (ranks holding the same block share the draw), no bigger
    firsts = []  # per leaf: the first rank holding each distinct block
    for r, spec in zip(ref_leaves, specs):
        keys = [tuple((b.start, b.stop) for b in local_block(r.shape, spec, mesh, c)) for c in coords]
        firsts.append([rank for rank, k in enumerate(keys) if k not in keys[:rank]])
    assert len(calls) == sum(map(len, firsts))
    at = 0
    for i, (r, spec, (got_spec, placements, shards), gathered) in enumerate(zip(ref_leaves, specs, placed, full)):
        assert got_spec.normalized() == spec.normalized()  # stored as the layout's params role says
        assert placements == to_placements(spec, mesh, r.shape)
        assert all(torch.equal(g, r) for g in gathered)  # bitwise, on every rank
        blocks = [local_block(r.shape, spec, mesh, c) for c in coords]
        assert all(torch.equal(s, r[b]) for s, b in zip(shards, blocks, strict=True))
        mine, at = calls[at : at + len(firsts[i])], at + len(firsts[i])
        assert [c.block for c in mine] == [tuple(shards[rank].shape) for rank in firsts[i]]
        for c in mine:
            assert c.shape == tuple(r.shape)
            rows = max(math.prod(c.block[:-1]), 1)
            # A rank computes its block and nothing bigger (+2 per row: Box-Muller draws pairs; the 2-word key).
            assert c.largest <= math.prod(c.block) + 2 * rows, (c, spec)
            if any(s != n for s, n in zip(c.block, r.shape)):
                assert c.largest < r.numel(), (c, spec)  # a sharded parameter is never materialized whole


@settings(max_examples=8)  # each case is one simulate run (~1 s); the @examples pin the key layouts
@given(cases())
@example(("gpt", Mesh(dp=2, tp=2), "zero3+tp+sp"))
@example(("gpt", Mesh(dp=2, fsdp=2), "hsdp"))
@example(("gpt", Mesh(dp=2, fsdp=2, tp=2), "zero3+tp"))  # 8 ranks, three axes
@example(("mlp", Mesh(tp=2), "tp"))
@example(("mlp", Mesh(dp=8), "zero3"))
@example(("mlp", Mesh(dp=3, fsdp=2), "zero3"))  # embed 6 over 6 ranks, vocab 13 over 6: uneven
def test_sharded_init_equals_single_device_init(case):
    _check_sharded_init(*case)


def test_layout_object_and_composition_string_agree():
    cfg = CONFIGS["gpt"]
    with simulate(4):
        mesh = Mesh(dp=2, tp=2)
        a = init(models.gpt.init, core.random.key(1), cfg, axes=models.gpt.axes(cfg), layout="tp+zero3", mesh=mesh)
        layout = layouts.get("zero3+tp")
        b = init(models.gpt.init, core.random.key(1), cfg, axes=models.gpt.axes(cfg), layout=layout, mesh=mesh)
        for x, y in zip(tree.leaves(a), tree.leaves(b), strict=True):
            assert x.placements == y.placements
            assert all(torch.equal(u, v) for u, v in zip(per_rank(x), per_rank(y), strict=True))


def test_materialized_leaves_are_sharded_too():
    def init_fn(key, cfg):  # arange is not a recipe: the init computes it, sharded init shards it
        return {"w": core.random.normal(key, (4, 6)), "pos": torch.arange(8.0).to(torch.float32)}

    axes = {"w": ("embed", "mlp"), "pos": ("embed",)}
    ref = init_fn(core.random.key(0), None)
    with simulate(2):
        params = init(init_fn, core.random.key(0), None, axes=axes, layout="zero3", mesh=Mesh(dp=2))
        assert [tuple(s.shape) for s in per_rank(params["pos"])] == [(4,), (4,)]
        full = gather(params)
    assert all(torch.equal(v, ref["pos"]) for v in per_rank(full["pos"]))
    assert all(torch.equal(v, ref["w"]) for v in per_rank(full["w"]))


def _gpt(**kw):
    return models.gpt.Config(**{**CONFIGS["gpt"].__dict__, **kw})


def test_layout_errors_come_before_any_work():
    calls = []

    def init_fn(key, cfg):
        calls.append(True)
        return models.mlp.init(key, cfg)

    cfg = CONFIGS["mlp"]
    with simulate(4), pytest.raises(ShardingError, match=r"layout 'tp': preset 'tp' needs a mesh axis tp"):
        init(init_fn, core.random.key(0), cfg, axes=models.mlp.axes(cfg), layout="tp", mesh=Mesh(dp=4))
    with pytest.raises(ShardingError, match="combines 'dp' and 'zero3'"):
        init(init_fn, core.random.key(0), cfg, axes=models.mlp.axes(cfg), layout="dp+zero3", mesh=Mesh(dp=1))
    assert not calls


def test_axes_tree_must_match_params():
    cfg = CONFIGS["mlp"]
    axes = models.mlp.axes(cfg)
    del axes["final_norm"]
    axes["blocks"][1]["bias"] = ("mlp",)
    with simulate(2), pytest.raises(ShardingError, match=r"axes tree does not match the params tree") as e:
        init(models.mlp.init, core.random.key(0), cfg, axes=axes, layout="zero3", mesh=Mesh(dp=2))
    msg = str(e.value)
    assert "['blocks'][1]['bias']" in msg and "['final_norm']" in msg and "Mesh(dp=2)" in msg
    assert "Fix:" in msg


def test_names_length_must_equal_ndim():
    cfg = CONFIGS["mlp"]
    axes = models.mlp.axes(cfg)
    axes["blocks"][0]["w_up"] = ("embed",)
    with pytest.raises(ShardingError, match=r"\['blocks'\]\[0\]\['w_up'\].*shape \(6, 10\).*have 1 entries but the"):
        param_specs(axes, models.mlp.init(core.random.key(0), cfg), "zero3", Mesh(dp=2))


def test_heads_must_divide_tp():
    cfg = _gpt(heads=3, kv_heads=3, dim=18)  # head_dim 6
    params = models.gpt.init(core.random.key(0), cfg)
    with pytest.raises(ShardingError) as e:
        param_specs(models.gpt.axes(cfg), params, "tp", Mesh(dp=2, tp=2))
    msg = str(e.value)
    assert "at ['blocks'][0]['wq']" in msg and "P(None, 'tp'" in msg and "Mesh(dp=2, tp=2)" in msg
    assert "dim 'heads' has size 3, not divisible by 2" in msg and "Fix:" in msg
    param_specs(models.gpt.axes(cfg), params, "zero3", Mesh(dp=2, tp=2))  # heads whole: fine


def test_non_tensor_leaf_is_a_type_error():
    with simulate(2), pytest.raises(TypeError, match=r"at \['scale'\].*leaf is a float, not a tensor"):
        init(lambda k, c: {"scale": 0.5}, core.random.key(0), None, axes={"scale": ()}, layout="dp", mesh=Mesh(dp=2))


@pytest.mark.parametrize(
    ("reshape", "op"),
    [
        (lambda w: torch.reshape(w, (-1,)), "reshape"),
        (lambda w: torch.cat([w, w]), "cat"),
        (lambda w: torch.matmul(w, w), "matmul"),
    ],
)
def test_init_that_transforms_a_draw_raises(reshape, op):
    def init_fn(key, cfg):
        return {"w": reshape(core.random.normal(key, (4, 4)))}

    with simulate(2), pytest.raises(TypeError, match=rf"deferred init: {op}\(\) was applied to a parameter.*Fix: draw"):
        init(init_fn, core.random.key(0), None, axes={"w": ("embed",)}, layout="zero3", mesh=Mesh(dp=2))


@pytest.mark.parametrize(
    ("transform", "op"),
    [(lambda w: w.reshape(16), "Tensor.reshape"), (lambda w: w.T, "Tensor.T"), (lambda w: w[0], "indexing")],
)
def test_init_that_transforms_a_draw_with_a_method_raises(transform, op):
    def init_fn(key, cfg):
        return {"w": transform(core.random.normal(key, (4, 4)))}

    with simulate(2), pytest.raises(TypeError, match=rf"deferred init: {op}\(\) was applied"):
        init(init_fn, core.random.key(0), None, axes={"w": ("embed",)}, layout="zero3", mesh=Mesh(dp=2))


def test_materialized_init_leaves_get_their_own_storage_per_rank():
    """An init that returns ready tensors (an nn.Module's weights): every simulated rank gets its own copy.

    Regression: the replicated ranks aliased the caller's one storage, so the local path's in-place
    update under ``dp`` ran once per rank on it and the params drifted (found writing docs/models.md).
    """
    weights = {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(0))}
    before = weights["w"].clone()
    with shardings.simulate(2):
        mesh = Mesh(dp=2)
        params = shardings.init(lambda key, cfg: dict(weights), core.random.key(0), None, axes={"w": ("embed", None)},
                                layout="dp", mesh=mesh)
        blocks = shardings.per_rank(params["w"])
        loss = lambda p, b: (p["w"].sum(0) * b["x"]).sum(-1).mean()
        step = shardings.train_step(loss, core.optim.sgd(0.5), layout="dp", mesh=mesh, axes={"w": ("embed", None)},
                                    donate=True)
        params, _, _ = step(params, step.init(params), {"x": torch.ones(2, 3)})
        after = shardings.per_rank(shardings.gather(params)["w"])
    assert len({b.untyped_storage().data_ptr() for b in blocks} | {weights["w"].untyped_storage().data_ptr()}) == 3
    assert torch.equal(weights["w"], before)  # the caller's tensors are not written
    for got in after:  # one SGD step: d(mean over rows of x · w.sum(0))/dw = 1 everywhere
        assert_close(got, before - 0.5 * torch.ones(4, 3))
