"""A precision policy under every layout: equivalence with the single-device reference run under the same policy,
bytes halved where the policy says so, memory per ZeRO stage, and a wrong reduction still caught in bf16.

The tolerance under bf16/fp16 is ``shardings.testing.tolerance.LOW_PRECISION_ULPS`` (its module docstring
says why: rtol 8·eps of the coarser of compute and reduce dtypes, no √terms).
"""

import functools

import pytest
import torch

import core
import shardings
from core.precision import Policy
from models import gpt, moe
from shardings import Mesh
from shardings.comm import flat_comm
from shardings.testing import EquivalenceError, check_equivalence

CFG = gpt.Config(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, mlp=64, seq_len=16)
BATCH = gpt.example_batch(CFG, 8)
BF16 = Policy.bf16_mixed()  # params fp32, compute bf16, reduce fp32 (FSDP2's usual MixedPrecisionPolicy)
BF16_REDUCE = Policy.from_string("params=fp32,compute=fp32,reduce=bf16")
BF16_ALL = Policy.from_string("params=fp32,compute=bf16,reduce=bf16")  # ZeRO paper's: bf16 params and grads
FP16 = Policy.fp16_mixed()  # with dynamic loss scaling from 2**16


def _check(layouts, mesh, precision, cfg=CFG, model=gpt, batch=BATCH, **kw):
    # the policy run alone: its fp32 twin (compute in fp32, the rest as the policy) is the fp32 run of the same
    # layout when the reduce dtype is fp32, which the fp32 suite checks; tests/shardings/testing/ checks the twin
    kw = {"steps": 3, "accum_steps": 2, "clip_norm": 1.0, "fp32_twin": False, **kw}
    report = check_equivalence(model.init, model.loss, model.axes, cfg, batch, layouts=layouts, mesh=mesh,
                               precision=precision, **kw)
    assert report.ok and len(report.rows) == 3 * kw["steps"] * len(layouts)
    return report


@pytest.mark.parametrize(("policy", "layouts"), [
    (BF16, ["dp", "zero1", "zero2", "zero3", "zero2+tp", "zero3+tp+sp"]),
    (BF16_REDUCE, ["zero2", "zero3+tp+sp"]),  # fp32 compute, bf16 reduction: the gradients' rounding alone
    (BF16_ALL, ["dp", "zero3"]),
    (FP16, ["zero1", "zero3", "zero2+tp"]),  # with the loss scale (2**16) on both sides
], ids=lambda v: str(v) if isinstance(v, Policy) else "+".join(v))
def test_data_and_tensor_parallel_layouts_match_the_reference_under_the_same_policy(policy, layouts):
    report = _check(layouts, Mesh(dp=2, tp=2), policy)
    assert max(r.used for r in report.rows) > 0.05  # the rule is not so loose that nothing registers


@pytest.mark.parametrize(("layout", "mesh"), [
    ("hsdp", Mesh(dp=2, fsdp=2)),
    ("zero3+cp", Mesh(dp=2, cp=2)),
    ("tp+sp+cp", Mesh(tp=2, cp=2)),
])
def test_hsdp_and_context_parallel_layouts_under_bf16(layout, mesh):
    _check([layout], mesh, BF16)


def test_expert_parallel_moe_under_bf16():
    cfg = moe.Config(vocab=32, dim=8, layers=1, heads=2, mlp=8, seq_len=4, experts=4, top_k=2, moe_every=1,
                     capacity_factor=1.0)
    _check(["dp+ep", "zero3+ep"], Mesh(dp=2, ep=2), BF16, cfg=cfg, model=moe, batch=moe.example_batch(cfg, 8))


def test_a_wrong_reduction_fails_in_bf16(monkeypatch):
    """The bf16 rule is looser than fp32's (6%), not blind: HSDP forgetting its all-reduce over the replicated
    dim (each dp group keeps the gradient of its own rows) must fail it."""
    real = flat_comm.launch_reduce

    def forgets_the_replicated_dim(comm, grads, target):
        return real(flat_comm.Comm(comm.mesh, comm.data_dims[-1:]), grads, target)

    monkeypatch.setattr(flat_comm, "launch_reduce", forgets_the_replicated_dim)
    with pytest.raises(EquivalenceError, match="grads"):
        _check(["hsdp"], Mesh(dp=2, fsdp=2), BF16, steps=1)


def _step_rows(layout, policy, mesh=None):
    mesh = mesh or Mesh(dp=4)
    with shardings.simulate(mesh.size):
        params = shardings.init(gpt.init, core.random.key(0), CFG, axes=gpt.axes(CFG), layout=layout, mesh=mesh)
        step = shardings.train_step(functools.partial(gpt.loss, cfg=CFG), core.optim.adamw(1e-3), layout=layout,
                                    mesh=mesh, precision=policy)
        state = step.init(params)
        _, _, metrics = step(params, state, BATCH)
    return {(r["kind"], r["axis"]): r["bytes"] for r in metrics["comm"]}, metrics["memory"]


@pytest.mark.parametrize("layout", ["zero2", "zero3", "zero3+tp"])
def test_zero_gathers_compute_dtype_bytes_and_reduces_in_the_reduce_dtype(layout):
    # zero3 casts its blocks before the gather; zero2 updates the fp32 master shard and gathers its bf16 copy
    mesh = Mesh(dp=4) if layout == "zero3" else Mesh(dp=2, tp=2)
    fp32, _ = _step_rows(layout, None, mesh)
    bf16, _ = _step_rows(layout, BF16, mesh)
    both, _ = _step_rows(layout, BF16_ALL, mesh)
    gather, scatter = ("all_gather", "dp"), ("reduce_scatter", "dp")
    assert bf16[gather] * 2 == fp32[gather] and both[gather] * 2 == fp32[gather]  # cast before the gather
    assert bf16[scatter] == fp32[scatter]  # reduce fp32: the same bytes
    # reduce bf16: half. Under tp the loss also reduce-scatters its per-token fp32 losses over dp in backward
    # (its own activations, the same in every policy): (n-1)/n of B*S*4 bytes, added back here.
    loss_own = BATCH["labels"].numel() * 4 // 2 if "tp" in layout else 0
    assert both[scatter] * 2 - loss_own == fp32[scatter]


# Bytes per rank of mixed-precision AdamW, P params on N = 4 data ranks: ZeRO's 2P + 2P + 12P (docs/layouts.md).
# zero1/zero2 keep the fp32 master with the optimizer state (sharded: 12P/N with Adam's moments) and store the bf16
# copy replicated, so no compute copy is made; zero3 and dp keep the fp32 params as the master (16P/N and 16P).
@pytest.mark.parametrize(("layout", "want"), [
    ("dp", dict(params=4, compute=2, grads=2, opt_state=8)),
    ("zero1", dict(params=2, compute=0, grads=2, opt_state=12 / 4)),
    ("zero2", dict(params=2, compute=0, grads=2 / 4, opt_state=12 / 4)),
    ("zero3", dict(params=4 / 4, compute=2 / 4, grads=2 / 4, opt_state=8 / 4)),
])
def test_memory_per_zero_stage_with_bf16_params_and_grads(layout, want):
    p = sum(x.numel() for x in core.tree.leaves(gpt.init(core.random.key(0), CFG)))
    _, memory = _step_rows(layout, BF16_ALL)
    for role, per_param in want.items():
        got = memory[role] - (4 if role == "opt_state" else 0)  # AdamW's int32 step count
        assert got == pytest.approx(per_param * p, rel=0.02), role  # tiny leaves (norms) round up per rank
    fp32 = _step_rows(layout, None)[1]
    assert fp32["compute"] == 0 and fp32["grads"] == 2 * memory["grads"]


@pytest.mark.parametrize("layout", ["zero1", "zero2+tp"])
def test_zero1_2_store_the_bf16_copy_of_the_sharded_fp32_master(layout):
    """The params a ZeRO-1/2 step returns under bf16 are its fp32 master (sharded in the optimizer state) rounded
    to bf16, bit for bit; the fp32 twin (compute fp32) keeps no separate master."""
    mesh = Mesh(dp=2, tp=2)
    with shardings.simulate(4):
        params = shardings.init(gpt.init, core.random.key(0), CFG, axes=gpt.axes(CFG), layout=layout, mesh=mesh)
        step = shardings.train_step(functools.partial(gpt.loss, cfg=CFG), core.optim.adamw(1e-2), layout=layout,
                                    mesh=mesh, precision=BF16)
        state = step.init(params)
        for _ in range(2):
            params, state, _ = step(params, state, BATCH)
        master = step.master_weights(params, state)
        assert all(shardings.spec_of(w) != shardings.spec_of(p)
                   for w, p in zip(core.tree.leaves(master), core.tree.leaves(params)) if w.ndim == 2)
        copy, whole = shardings.gather(params), shardings.gather(master)
        for c, w in zip(core.tree.leaves(copy), core.tree.leaves(whole)):
            assert c.dtype == torch.bfloat16 and w.dtype == torch.float32
            assert torch.equal(shardings.unwrap(c), shardings.unwrap(w).to(torch.bfloat16))
        twin = shardings.train_step(functools.partial(gpt.loss, cfg=CFG), core.optim.adamw(1e-2), layout=layout,
                                    mesh=mesh, precision=Policy.fp32())
        p32 = shardings.init(gpt.init, core.random.key(0), CFG, axes=gpt.axes(CFG), layout=layout, mesh=mesh)
        assert twin.master_weights(p32, twin.init(p32)) is p32


def test_fp16_skips_a_step_with_an_inf_gradient_on_one_rank_and_halves_the_scale():
    mesh = Mesh(dp=2, tp=2)
    with shardings.simulate(4):
        params = shardings.init(gpt.init, core.random.key(0), CFG, axes=gpt.axes(CFG), layout="zero2+tp", mesh=mesh)
        step = shardings.train_step(functools.partial(gpt.loss, cfg=CFG), core.optim.adamw(1e-3), layout="zero2+tp",
                                    mesh=mesh, precision=FP16)
        state = step.init(params)
        assert float(step.loss_scale(state)) == 2.0**16
        params, state, _ = step(params, state, BATCH)  # one clean step
        before = [x.clone() for x in shardings.per_rank(shardings.gather(params)["blocks"][0]["w_up"])]
        opt_before = [t.to_local().clone() for t in core.tree.leaves(state.opt) if hasattr(t, "to_local")]
        _, grads, _ = step.grads(params, BATCH, step.loss_scale(state))
        w_up = grads["blocks"][1]["w_up"]  # sharded over tp (and dp): rank 3's block alone gets the inf
        w_up.to_local()._local_tensors[3].view(-1)[0] = float("inf")
        new_params, new_state = step.apply(params, state, grads)
        assert int(new_state.loss_scale.skipped) == 1 and float(new_state.loss_scale.scale) == 2.0**15
        after = shardings.per_rank(shardings.gather(new_params)["blocks"][0]["w_up"])
        assert all(torch.equal(a, b) for a, b in zip(after, before))  # bitwise, on every rank
        opt_after = [t.to_local() for t in core.tree.leaves(new_state.opt) if hasattr(t, "to_local")]
        assert all(torch.equal(a, b) for a, b in zip(opt_after, opt_before))
        _, state, _ = step(new_params, new_state, BATCH)  # and the next clean step trains again
        assert int(state.loss_scale.skipped) == 1 and int(state.loss_scale.good_steps) == 1


def test_dynamic_loss_scale_grows_after_clean_steps_and_never_drops_below_its_floor():
    s = core.precision.DynamicLossScale(initial=4.0, growth_interval=3, min_scale=2.0)
    state = s.init()
    scales = []
    for finite in [True, True, True, False, False, False, True]:
        state = s.adjust(state, finite)
        scales.append(float(state.scale))
    assert scales == [4.0, 4.0, 8.0, 4.0, 2.0, 2.0, 2.0] and int(state.skipped) == 3
    with pytest.raises(ValueError, match="Fix: "):
        core.precision.DynamicLossScale(factor=1.0)
