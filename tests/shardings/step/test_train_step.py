"""train_step: every layout computes what one device computes, with the collectives and memory it should."""

import dataclasses
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial

import core
import models.gpt as gpt
import shardings
from core import tree
from shardings import Mesh
from shardings.comm import buckets
from shardings.residency import gather_params
from shardings.spec import layouts
from shardings.testing import EquivalenceError, check_equivalence, meshes
from shardings.testing import layouts as layout_strategy

CFG = gpt.Config(vocab=64, dim=32, layers=1, heads=4, kv_heads=2, mlp=64, seq_len=8)


@st.composite
def cases(draw):
    """A mesh over dp/fsdp/tp (1-8 ranks), a layout it can run, and a gpt config and batch that fit both."""
    mesh = draw(meshes(max_ranks=8, max_axes=3, axis_names=("dp", "fsdp", "tp")))
    layout = draw(layout_strategy(mesh))
    tp = mesh.shape.get("tp", 1) if "tp" in layout.split("+") else 1
    data = mesh.size // mesh.shape.get("tp", 1)
    kv_heads = draw(st.sampled_from([tp, 2 * tp] if tp > 1 else [1, 2, 4]))  # MQA/GQA/MHA where tp allows
    heads = kv_heads * draw(st.sampled_from([1, 2]))
    cfg = gpt.Config(
        vocab=draw(st.integers(17, 40)),  # rarely divisible by tp: uneven vocab shards
        dim=heads * 4,
        layers=draw(st.integers(1, 2)),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=4,
        mlp=draw(st.sampled_from([16, 24])),
        seq_len=4,
        tie_embeddings=draw(st.booleans()),
    )
    accum = draw(st.sampled_from([1, 2]))
    batch = gpt.example_batch(cfg, data * accum, seed=draw(st.integers(0, 3)), with_ignored=draw(st.booleans()))
    return mesh, layout, cfg, batch, accum, draw(st.sampled_from([None, 0.05]))


@given(cases())
@settings(max_examples=8)
def test_random_layouts_match_the_single_device_reference(case):
    mesh, layout, cfg, batch, accum, clip = case
    report = check_equivalence(
        gpt.init, gpt.loss, gpt.axes, cfg, batch, layouts=[layout], mesh=mesh, steps=3, accum_steps=accum,
        clip_norm=clip,
    )
    assert len(report.rows) == 3 * 3 and report.ok


def test_a_rank_dependent_model_fails_equivalence_naming_the_path():
    def skewed_loss(params, batch, cfg):
        # A deliberate bug: each data-parallel rank scales the loss by (its index + 1) yet claims
        # the result is replicated. Rank 0 alone looks right; the other ranks' values do not.
        loss, ctx = gpt.loss(params, batch, cfg), shardings.current()
        if ctx is None:
            return loss
        scale = functools.partial(lambda x: x * (shardings.axis_index("dp") + 1))
        return shardings.shard_map(scale, ctx.mesh, in_specs=shardings.P(), out_specs=shardings.P())(loss)

    with pytest.raises(EquivalenceError, match=r"(?s)layout 'dp'.*differ.*worst at .*grads .* FAIL \['"):
        # local=False: the skew needs the mesh inside the loss, which the local path does not expose.
        check_equivalence(gpt.init, skewed_loss, gpt.axes, CFG, gpt.example_batch(CFG, 2), layouts=["dp"],
                          mesh=Mesh(dp=2), steps=1, local=False)


@pytest.mark.parametrize(("layout", "mesh", "local"), [
    ("dp", Mesh(dp=4), True), ("zero3", Mesh(dp=4), False), ("hsdp", Mesh(dp=2, fsdp=2), True),
    ("tp", Mesh(tp=2), False), ("zero3+tp+sp", Mesh(dp=2, tp=2), False),
])
def test_the_grad_norm_metric_is_the_norm_of_the_single_device_gradients(layout, mesh, local):
    """Norms of local blocks, summed over the mesh dims that split them: nothing counted twice or missed."""
    batch = gpt.example_batch(CFG, 4, with_ignored=True)
    params = gpt.init(core.random.key(0), CFG)
    leaves = [p.requires_grad_(True) for p in tree.leaves(params)]
    want = core.optim.global_norm(torch.autograd.grad(gpt.loss(params, batch, CFG), leaves))
    with shardings.simulate(mesh.size):
        sharded = shardings.init(gpt.init, core.random.key(0), CFG, axes=gpt.axes(CFG), layout=layout, mesh=mesh)
        step = shardings.train_step(functools.partial(gpt.loss, cfg=CFG), core.optim.sgd(0.1), layout=layout,
                                    mesh=mesh, local=local)
        _, _, metrics = step(sharded, step.init(sharded), batch)
    assert metrics["grad_norm"] == pytest.approx(float(want), rel=1e-5)


# -- collectives: kinds, counts, axes and bytes of one step (docs/layouts.md's tables) ---------------------------------


def _one_step_comm(layout, mesh, cfg=CFG, batch_size=4, bucket_mb=buckets.DEFAULT_BUCKET_MB, local=True):
    batch = gpt.example_batch(cfg, batch_size)
    with shardings.simulate(mesh.size):
        params = shardings.init(gpt.init, core.random.key(0), cfg, axes=gpt.axes(cfg), layout=layout, mesh=mesh)
        step = shardings.train_step(functools.partial(gpt.loss, cfg=cfg), core.optim.adamw(1e-3), layout=layout,
                                    mesh=mesh, bucket_mb=bucket_mb, local=local)
        _, _, metrics = step(params, step.init(params), batch)
        metrics["local_plan"] = step.plan(params).local
    return {(r["kind"], r["axis"]): (r["count"], r["bytes"]) for r in metrics["comm"]}, metrics


def _leaves(cfg=CFG):
    return tree.leaves(gpt.init(core.random.key(0), cfg))


def _ring(kind, n, nbytes):
    return nbytes * 2 * (n - 1) // n if kind == "all_reduce" else nbytes * (n - 1) // n


# The local path (data-parallel layouts) all-reduces two scalars besides the layout's collectives:
# the global token count (int64, before backward: each rank weighs its loss by its share) and the loss.
_SCALARS = (2, _ring("all_reduce", 4, 8) + _ring("all_reduce", 4, 4))


def _plus(a, b):
    return (a[0] + b[0], a[1] + b[1])


@pytest.mark.parametrize("local", [True, False])
@pytest.mark.parametrize(("bucket_mb", "collectives"), [(25, 1), (None, len(_leaves()))])
def test_dp_all_reduces_every_grad_over_dp_only(bucket_mb, collectives, local):
    # Bucketed (the whole tiny model fits one 25 MB bucket) or one all-reduce per gradient: same bytes.
    n, leaves = 4, _leaves()
    comm, metrics = _one_step_comm("dp", Mesh(dp=n), bucket_mb=bucket_mb, local=local)
    four_p = sum(4 * x.numel() for x in leaves)
    want = (collectives, _ring("all_reduce", n, four_p))
    assert (metrics["local_plan"] is not None) == local
    assert comm == {("all_reduce", "dp"): _plus(want, _SCALARS) if local else want}


@pytest.mark.parametrize(("layout", "mesh", "local"),
                         [("dp", Mesh(dp=4), True), ("dp", Mesh(dp=4), False), ("dp+tp", Mesh(dp=2, tp=2), False)])
@pytest.mark.parametrize("bucket_mb", [0.0001, 0.002, 25])
def test_collective_counts_per_step_with_bucketing_match_the_bucket_plan(layout, mesh, local, bucket_mb, monkeypatch):
    seen = []  # the gradients the DTensor path reduces, as backward left them
    reduce = buckets.reduce
    monkeypatch.setattr(buckets, "reduce", lambda g, t, mb: seen.append((g, t, mb)) or reduce(g, t, mb))
    comm, metrics = _one_step_comm(layout, mesh, bucket_mb=bucket_mb, local=local)
    n_grads = len(_leaves())
    if local:  # buckets in backward order, each all-reduced as soon as its last gradient is produced
        plan = metrics["local_plan"].reduces
        assert not seen and comm[("all_reduce", "dp")][0] == len(plan) + _SCALARS[0]
        assert sorted(i for b in plan for i in b) == list(range(n_grads))
        assert [i for b in plan for i in b] == list(range(n_grads))[::-1]
        sizes = [sum(4 * _leaves()[i].numel() for i in b) for b in plan]
        assert all(s <= bucket_mb * 1e6 or len(b) == 1 for s, b in zip(sizes, plan))
        if bucket_mb == 0.0001:  # 100 bytes: every leaf of CFG is bigger, so one bucket each
            assert len(plan) == n_grads
        return
    ((grads, targets, mb),) = seen
    with shardings.simulate(mesh.size):
        bucket_plan = buckets.plan(grads, targets, mb)
    dp = mesh.axis_names.index("dp")
    assert mb == bucket_mb and len(bucket_plan) > 0
    # One all-reduce over dp per bucket (a bucket also Partial over tp adds one over tp), none per leaf.
    assert comm[("all_reduce", "dp")][0] == sum(isinstance(b.source[dp], Partial) for b in bucket_plan)
    assert sorted(i for b in bucket_plan for i in b.leaves) == list(range(len(grads)))
    assert all(b.nbytes <= bucket_mb * 1e6 or len(b.leaves) == 1 for b in bucket_plan)
    if bucket_mb == 0.0001:
        assert len(bucket_plan) == len(grads)


@pytest.mark.parametrize("local", [True, False])
@pytest.mark.parametrize("layout", ["zero1", "zero2"])
def test_zero12_reduce_scatter_grads_and_all_gather_params_same_volume_as_dp(layout, local):
    n, leaves = 4, _leaves()
    comm, _ = _one_step_comm(layout, Mesh(dp=n), local=local)
    four_p = sum(4 * x.numel() for x in leaves)
    count = 1 if local else len(leaves)  # local: one bucket each way; DTensor path: one per leaf
    want = {
        ("reduce_scatter", "dp"): (count, _ring("reduce_scatter", n, four_p)),
        ("all_gather", "dp"): (count, _ring("all_gather", n, four_p)),
    }
    if local:
        want[("all_reduce", "dp")] = _SCALARS
    assert comm == want
    assert comm[("reduce_scatter", "dp")][1] + comm[("all_gather", "dp")][1] == _ring("all_reduce", n, four_p)


def test_zero3_gathers_forward_regathers_backward_and_reduce_scatters():
    n, params = 4, gpt.init(core.random.key(0), CFG)
    comm, _ = _one_step_comm("zero3", Mesh(dp=n))
    four_p = sum(4 * x.numel() for x in tree.leaves(params))
    # Local path, one bucket per block plus one for the rest (FSDP's units): each all-gathered for
    # forward, the blocks' again in backward (the rest stays gathered, as FSDP2's root module does),
    # then reduce-scattered: docs/layouts.md's 1.5× dp, less the root's backward gather.
    units, root = CFG.layers + 1, 4 * sum(params[k].numel() for k in ("embed", "final_norm", "unembed"))
    assert comm == {
        ("all_gather", "dp"): (2 * units - 1, _ring("all_gather", n, 2 * four_p - root)),
        ("reduce_scatter", "dp"): (units, _ring("reduce_scatter", n, four_p)),
        ("all_reduce", "dp"): _SCALARS,
    }
    total = sum(b for _, b in comm.values()) - _SCALARS[1]
    assert total == 1.5 * _ring("all_reduce", n, four_p) - _ring("all_gather", n, root)


@pytest.mark.parametrize("bucket_mb", [25, None])
def test_zero3_on_the_dtensor_path_gathers_and_reduces_per_bucket(bucket_mb):
    n, params = 4, gpt.init(core.random.key(0), CFG)
    comm, _ = _one_step_comm("zero3", Mesh(dp=n), local=False, bucket_mb=bucket_mb)
    four_p, leaves = sum(4 * x.numel() for x in tree.leaves(params)), len(tree.leaves(params))
    if bucket_mb:  # a bucket per block and one for the rest: gathered, blocks again in backward, reduce-scattered
        units, root = CFG.layers + 1, 4 * sum(params[k].numel() for k in ("embed", "final_norm", "unembed"))
        assert comm == {
            ("all_gather", "dp"): (2 * units - 1, _ring("all_gather", n, 2 * four_p - root)),
            ("reduce_scatter", "dp"): (units, _ring("reduce_scatter", n, four_p)),
        }
        return
    # One collective per weight; backward re-gathers only the weights autograd saved (the embedding
    # lookup's backward needs none).
    regathered = four_p - 4 * params["embed"].numel()
    assert comm == {
        ("all_gather", "dp"): (2 * leaves - 1, _ring("all_gather", n, four_p + regathered)),
        ("reduce_scatter", "dp"): (leaves, _ring("reduce_scatter", n, four_p)),
    }


@pytest.mark.parametrize("layers", [1, 2])
def test_tp_two_all_reduces_per_block_forward_and_two_backward(layers):
    cfg = dataclasses.replace(CFG, layers=layers)
    comm, _ = _one_step_comm("tp", Mesh(tp=2), cfg=cfg)
    bsh = 4 * cfg.seq_len * cfg.dim * 4  # one (batch, seq, embed) fp32 activation
    bs = 4 * cfg.seq_len * 4  # one (batch, seq) fp32 value per token
    # 4 per block, plus the vocab-parallel embedding (forward) and the unembedding's input (backward);
    # the vocab-parallel loss reduces per-token values only (the target logit, and its logsumexp's
    # max and sum): the logits stay sharded.
    assert comm == {("all_reduce", "tp"): (4 * layers + 5, (4 * layers + 2) * _ring("all_reduce", 2, bsh)
                                           + 3 * _ring("all_reduce", 2, bs))}


def test_sp_turns_tp_all_reduces_into_all_gather_and_reduce_scatter():
    comm, _ = _one_step_comm("tp+sp", Mesh(tp=2))
    bsh = 4 * CFG.seq_len * CFG.dim * 4
    ag_count, ag_bytes = comm[("all_gather", "tp")]
    rs_count, rs_bytes = comm[("reduce_scatter", "tp")]
    # Per block: gather before each TP matmul pair, scatter after, mirrored in backward; plus the
    # vocab-parallel embedding's scatter (its lookup is a partial sum over vocab shards) and the final
    # norm's gather, each mirrored in backward. The norm weights' gradients are all-reduced (they see
    # seq shards), bucketed; nothing else moves: no weight, no logits.
    bs = 4 * CFG.seq_len * 4  # (batch, seq) fp32: the loss's per-token values (target logit, logsumexp)
    assert (ag_count, ag_bytes) == (6, 6 * _ring("all_gather", 2, bsh))
    assert (rs_count, rs_bytes) == (6, 6 * _ring("reduce_scatter", 2, bsh))
    # one bucket of 3 norms; the loss's target logit, and its logsumexp's max and sum
    assert comm[("all_reduce", "tp")] == (4, 3 * _ring("all_reduce", 2, 4 * CFG.dim) + 3 * _ring("all_reduce", 2, bs))
    assert set(comm) == {("all_gather", "tp"), ("reduce_scatter", "tp"), ("all_reduce", "tp")}


# -- memory: persistent bytes per rank (docs/layouts.md's memory table) ------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "params", "grads", "opt"),
    [("dp", 4, 4, 8), ("zero1", 4, 4, 8 / 4), ("zero2", 4, 4 / 4, 8 / 4), ("zero3", 4 / 4, 4 / 4, 8 / 4)],
)
def test_persistent_memory_per_rank_matches_zero_stages(layout, params, grads, opt):
    n_params = sum(x.numel() for x in _leaves())
    _, metrics = _one_step_comm(layout, Mesh(dp=4))
    got = metrics["memory"]
    for role, factor in (("params", params), ("grads", grads), ("opt_state", opt)):
        assert got[role] == pytest.approx(factor * n_params, rel=0.05), role


def _saved_for_backward(layout, mesh, cfg, monkeypatch, local):
    """Bytes autograd keeps alive for backward (per rank, max): what the step's saved-tensor hook keeps."""
    held = []
    owner, name = gather_params.Regather, "pack"  # both paths save through it
    pack = getattr(owner, name)

    def recording_pack(*args):
        saved = pack(*args)
        if isinstance(saved, torch.Tensor):  # a re-gather handle holds only a reference to the shard
            held.append(saved)
        return saved

    monkeypatch.setattr(owner, name, recording_pack)
    batch = gpt.example_batch(cfg, 4)
    with shardings.simulate(mesh.size):
        params = shardings.init(gpt.init, core.random.key(0), cfg, axes=gpt.axes(cfg), layout=layout, mesh=mesh)
        step = shardings.train_step(functools.partial(gpt.loss, cfg=cfg), core.optim.sgd(0.1), layout=layout,
                                    mesh=mesh, local=local)
        step.grads(params, batch)
        return shardings.memory(held)


@pytest.mark.parametrize("local", [True, False])
def test_zero3_keeps_no_gathered_weights_for_backward(monkeypatch, local):
    cfg = dataclasses.replace(CFG, dim=64, mlp=256, heads=4, kv_heads=4)  # weights dominate activations
    dp = _saved_for_backward("dp", Mesh(dp=4), cfg, monkeypatch, local)
    zero3 = _saved_for_backward("zero3", Mesh(dp=4), cfg, monkeypatch, local)
    weights = sum(4 * x.numel() for x in _leaves(cfg))
    assert zero3 < dp - weights / 2, (dp, zero3, weights)


# -- errors ---------------------------------------------------------------------------------------------


def test_batch_not_divisible_by_data_ranks_times_accumulation_is_a_clear_error():
    with shardings.simulate(2):
        mesh = Mesh(dp=2)
        params = shardings.init(gpt.init, core.random.key(0), CFG, axes=gpt.axes(CFG), layout="dp", mesh=mesh)
        step = shardings.train_step(functools.partial(gpt.loss, cfg=CFG), core.optim.sgd(0.1), layout="dp",
                                    mesh=mesh, accum_steps=2)
        with pytest.raises(ValueError, match=r"\['tokens'\].*batch size=2 is not divisible by 4 \(2 data-parallel "
                                             r"ranks × 2 accumulation steps\).*Fix: set the global batch size to a "
                                             r"multiple of 4"):
            step(params, step.init(params), gpt.example_batch(CFG, 2))


def test_a_layout_that_leaves_a_mesh_axis_idle_repeats_the_work_along_it():
    # tp+sp maps nothing to dp: both dp rows run the same step, and every rank matches one device.
    report = check_equivalence(gpt.init, gpt.loss, gpt.axes, CFG, gpt.example_batch(CFG, 4), layouts=["tp+sp"],
                               mesh=Mesh(dp=2, tp=2), steps=2)
    assert report.ok


def test_a_batch_that_differs_between_simulated_ranks_is_a_clear_error():
    with shardings.simulate(2):
        params = shardings.init(gpt.init, core.random.key(0), CFG, axes=gpt.axes(CFG), layout="tp", mesh=Mesh(tp=2))
        step = shardings.train_step(functools.partial(gpt.loss, cfg=CFG), core.optim.sgd(0.1), layout="tp",
                                    mesh=Mesh(tp=2))
        batch = gpt.example_batch(CFG, 4)  # drawn inside simulate(): each rank gets its own tokens
        with pytest.raises(ValueError, match=r"\['tokens'\].*different values on different simulated ranks.*"
                                             r"Fix: build the batch before entering shardings.simulate"):
            step(params, step.init(params), batch)


def test_layout_needing_an_absent_axis_fails_before_any_work():
    with pytest.raises(ValueError, match=r"Mesh\(dp=4\).*preset 'tp' needs a mesh axis tp"):
        shardings.train_step(lambda p, b: 0, core.optim.sgd(0.1), layout="zero3+tp", mesh=Mesh(dp=4))


def test_params_without_logical_names_need_axes():
    with shardings.simulate(2):
        params = shardings.shard({"w": torch.ones(4)}, shardings.P(), Mesh(dp=2))
        step = shardings.train_step(lambda p, b: p["w"].sum(), core.optim.sgd(0.1), layout="dp", mesh=Mesh(dp=2))
        with pytest.raises(TypeError, match=r"pass axes="):
            step.init(params)


# -- real processes ----------------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_layouts_on_four_real_gloo_ranks_match_the_reference():
    report = check_equivalence(
        gpt.init, gpt.loss, gpt.axes, CFG, gpt.example_batch(CFG, 4, with_ignored=True),
        layouts=["dp", "zero3", "tp+sp", "zero3+tp+sp"], mesh=Mesh(dp=2, tp=2), steps=2, runtime="multiprocess",
    )
    assert report.ok and {r.layout for r in report.rows} == {"dp", "zero3", "tp+sp", "zero3+tp+sp"}


@pytest.mark.multiprocess
def test_donated_steps_with_the_fused_optimizer_match_the_reference_on_real_ranks():
    # AdamW runs torch's fused kernel in place on each rank's plain shard; zero2 gathers the updated shards back.
    report = check_equivalence(
        gpt.init, gpt.loss, gpt.axes, CFG, gpt.example_batch(CFG, 4), layouts=["dp", "zero2", "zero3"],
        mesh=Mesh(dp=2), steps=3, runtime="multiprocess", donate=True,
    )
    assert report.ok


def test_layouts_registry_has_the_documented_presets():
    assert {"dp", "zero1", "zero2", "zero3", "fsdp", "hsdp", "tp", "sp"} <= set(layouts.names())
